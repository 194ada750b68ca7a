"""The probe as a Hugging Face ``TrainerCallback``: your ``Trainer`` script, unchanged.

    from sharded_exp.integrations.transformers import MemoryProbe

    trainer = Trainer(model, args, train_dataset=..., callbacks=[MemoryProbe("outputs/mine/ddp")])

Per rank: the peak over a window after warm-up, its split, the median step time; the
strategy from the ``TrainingArguments`` (``fsdp``, ``deepspeed``, else DDP when distributed)
in ``config.framework`` and in sharded_exp's names; the fake-step prediction of the peak from
the model's first call (its keyword arguments, as the Trainer passes the batch; ``loss``
from the output). Rank 0 writes ``<run_dir>/result.json`` when training ends, and the same
summary keys into the W&B run the Trainer's ``WandbCallback`` opened, if any.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from sharded_exp.precision import Precision
from sharded_exp.probe import Probe
from sharded_exp.probe.fake import loss_of
from sharded_exp.strategies import name_of_wrapper_class


def _strategy(args) -> tuple[str, tuple[bool, bool]]:
    """sharded_exp's name for the Trainer's strategy, and (under DDP, gradients as bucket views)."""
    fsdp = " ".join(str(o) for o in (args.fsdp or [])) if not isinstance(args.fsdp, str) else args.fsdp
    if fsdp:  # the Trainer's FSDP is FSDP1: its sharding strategy says which of ours
        how = "SHARD_GRAD_OP" if "shard_grad_op" in fsdp else "FULL_SHARD"
        return name_of_wrapper_class(FullyShardedDataParallel, how), (False, False)
    if args.deepspeed:
        return "deepspeed", (False, False)
    if args.world_size > 1:
        # the Trainer does not ask DDP for bucket views
        return name_of_wrapper_class(DistributedDataParallel), (True, False)
    return "single", (False, False)


class MemoryProbe(TrainerCallback):
    def __init__(
        self, run_dir: str | None = None, *, warmup_steps: int = 5, track_steps: int = 2, predict: bool = True
    ):
        self.run_dir, self.predict = run_dir, predict
        self.options = {"warmup_steps": warmup_steps, "track_steps": track_steps}
        self.probe: Probe | None = None
        self.result: Any = None  # rank 0: the probe's result (sharded_exp.job.result.Result) once training ended
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        name, ddp = _strategy(args)
        precision = (Precision.bf16 if args.bf16 else Precision.fp16 if args.fp16 else Precision.fp32).value
        self.probe = Probe(
            model,
            optimizer,
            self.run_dir,
            samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
            precision=precision,
            strategy=name,
            ddp=ddp,
            source="transformers",
            grad_accum=args.gradient_accumulation_steps,
            framework={
                "name": "transformers",
                "version": transformers.__version__,
                "world_size": args.world_size,
                "fsdp": str(args.fsdp or ""),
                "deepspeed": bool(args.deepspeed),
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
            },
            **self.options,
        )
        if self.predict:
            self._hook = model.register_forward_pre_hook(self._first_call, with_kwargs=True)

    def _first_call(self, module, args, kwargs):
        """The model's first call: its batch predicts the step (inside the Trainer's autocast)."""
        self._hook.remove()
        batch = {**kwargs, **{f"_{i}": a for i, a in enumerate(args)}}

        def step(m, b):
            positional = [b.pop(k) for k in sorted(k for k in b if k.startswith("_"))]
            return loss_of(m(*positional, **b))

        self.probe.predict(batch, step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.probe is not None:
            self.probe.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.probe is None:
            return
        losses = [r["loss"] for r in state.log_history if "loss" in r]
        if losses:
            self.probe.losses = [torch.tensor(losses[-1])]
        self.result = self.probe.close()
