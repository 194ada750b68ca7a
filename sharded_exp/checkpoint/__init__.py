"""Checkpoints in two formats that every strategy writes and reads, keyed by name.

    python -m sharded_exp.checkpoint export SRC DST    # a dcp checkpoint -> consolidated

The package owns a checkpoint's lifecycle, one module per part:

- :mod:`.plan`: before any rank starts, what to resume, refuse or archive (the parent's
  :class:`CheckpointPlan`, part of the job spec);
- :mod:`.storage`: names, discovery, validation, atomic publish, keep-k, the directory lock;
- :mod:`.state`: the state by parameter name, gathered and restored in any layout (a strategy
  gathers its own sharded optimizer state: ``Strategy.gather_optimizer_state``);
- :mod:`.manager`: the training loop's side (load, after a step, on a stop, finish);
- :mod:`.export`: the export command.

A checkpoint is a directory ``<checkpoint_dir>/step_00000010/``. Its ``meta.json`` (step,
format, strategy, world size, precision, optimizer, model config, every parameter's
shape; read by the parent to reject a wrong checkpoint before any rank starts) and
``train.pt`` (grad scaler state, every rank's RNG state, the optimizer's parameter groups
by name) are the same in both formats. The tensors are either

- ``dcp`` (``trainer.checkpoint_format=dcp``, the default for every strategy that shards
  something): torch.distributed.checkpoint files. Each rank writes and reads only its own
  shards: the model state (FSDP2's DTensors, or one copy of replicated tensors), and the
  optimizer state of the parameters its local optimizers hold, under parameter names
  (``optim.state.<name>.<key>``). Loading reshards to any world size and strategy: a rank
  asks for the parameters it holds, in its own layout. With
  ``trainer.checkpoint_async=true`` the files are written by a background thread while
  training goes on; or
- ``consolidated`` (the default for ddp, and for exchange): ``model.pt`` and ``optim.pt``
  with the full state, written by rank 0. They are gathered one tensor at a time to rank
  0's CPU: no rank other than rank 0 ever holds more than one tensor of it.

The data position of a synthetic task is the step (batches are a pure function of step,
micro-batch and rank), so a checkpoint written under one strategy and world size resumes
under any other. A user's dataset is read as a stream (a DataLoader): meta.json's
``data`` holds its position (epoch, samples consumed in it), where a resumed run starts.

Writes are atomic: the files go into ``.step_00000010.tmp.<job>/`` (unique per job),
``meta.json`` last, fsynced, then rank 0 renames the directory to ``step_00000010``. A
directory named ``step_*`` is complete by construction; a kill at any moment leaves at
most a ``.tmp.*`` directory that readers ignore.
"""

import importlib

_FROM = {
    "CheckpointManager": "manager",
    "load": "manager",
    "CheckpointPlan": "plan",
    "check_compatible": "plan",
    "plan_checkpoints": "plan",
    "resolve_resume": "plan",
    "resume_step": "plan",
    "gather_model_state": "state",
    "gather_optimizer_state": "state",
    "restore": "state",
    "FILES": "storage",
    "FORMATS": "storage",
    "CheckpointError": "storage",
    "checkpoint_format": "storage",
    "complete_checkpoints": "storage",
    "read_meta": "storage",
    "step_name": "storage",
}
"""Where each name the package exports is defined. They are imported when first asked for
(PEP 562): the plan and storage modules need no torch, and the job's parent, which reads a
spec's :class:`CheckpointPlan`, never imports the manager and the state (torch's DTensor and
sympy, half a second at start-up)."""


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "FILES",
    "FORMATS",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointPlan",
    "check_compatible",
    "checkpoint_format",
    "complete_checkpoints",
    "gather_model_state",
    "gather_optimizer_state",
    "load",
    "plan_checkpoints",
    "read_meta",
    "resolve_resume",
    "restore",
    "resume_step",
    "step_name",
]
