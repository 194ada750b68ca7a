"""The job spec: everything the parent's pre-flight decided, frozen, as the ranks receive it.

Pre-flight (:func:`sharded_exp.launch.preflight.check`) reads the composed config and never
changes it; what it decides (the world size torchrun or SLURM started, the device, the
checkpoint plan, how gradients are cleared, the memory prediction) is here. ``typed`` is the
resolved config with those decisions applied, as its schemas' dataclasses: what the ranks
read (:meth:`JobSpec.cfg`), with the same types as the composed config (options as enum
members). ``config`` is the same as plain data, every option as its name: what result.json's
``config`` and W&B show.
"""

from __future__ import annotations

import copy
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sharded_exp import logs
from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.config import Config, GradZeroing, typed


@dataclass(frozen=True)
class Pickled:
    """A value that travels pickled and is unpickled only where it is read (:meth:`JobSpec.typed_config`)."""

    data: bytes


@dataclass(frozen=True)
class JobSpec:
    """One job as the parent hands it to its ranks (picklable, immutable)."""

    config: dict[str, Any]
    """The resolved config, plain data, with the decisions below applied (result.json, W&B)."""
    output_dir: str
    device_type: str
    """cuda or cpu: decided once, for the whole job."""
    world_size: int
    """Ranks of the job: trainer.world_size, or what torchrun / SLURM started."""
    params: int
    """Parameters of the model (counted on the meta device)."""
    prediction: dict[str, Any]
    """Predicted memory per rank (sharded_exp.predict.prediction.predict)."""
    zero_grad: GradZeroing
    """How gradients are cleared: trainer.zero_grad as the strategy applies it."""
    checkpoint: CheckpointPlan
    config_yaml: str = ""
    """The decided config as Hydra writes it (interpolations kept): ``.hydra/config.yaml``."""
    launcher: str = "spawn"
    """spawn (the parent starts the ranks), torchrun or slurm."""
    env: dict[str, str] = field(default_factory=dict)
    """The job's SHARDED_EXP_* variables (a forked rank inherits the server's environment)."""
    parent_pid: int | None = None
    """The launching process: spawned ranks exit when it is gone."""
    log_file: str | None = None
    """Where the parent's job logging writes (``<run dir>/sharded_exp.log``): spawned ranks append to it."""
    log_level: int = 20
    """The level of our package's loggers in the parent (INFO; DEBUG with hydra.verbose)."""
    typed: Any = None
    """``config`` as its schemas' dataclasses (:func:`sharded_exp.config.typed`), checked."""
    wait_for_release: bool = False
    """Whether the ranks, once built, wait for the parent's word before their first step: the
    peak prediction, made while they start (``python -m sharded_exp``'s spawned ranks,
    :func:`sharded_exp.launch.preflight.check_in_two`), or none where the job was refused."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with ``typed`` pickled apart (:class:`Pickled`): unpickling the spec then
        imports none of the modules its schemas live in (every strategy, model and data task,
        and torch's with them), which the parent of ``python -m sharded_exp`` never needs."""
        state = dict(self.__dict__)
        if self.typed is not None and not isinstance(self.typed, Pickled):
            state["typed"] = Pickled(pickle.dumps(self.typed))
        return state

    def typed_config(self) -> Any:
        """``typed``, unpickled where it came pickled."""
        return pickle.loads(self.typed.data) if isinstance(self.typed, Pickled) else self.typed

    def cfg(self) -> DictConfig:
        """``typed`` as a read-only OmegaConf tree: what the ranks read, typed as the composed
        config is (the schemas' enums), with attribute and key access alike."""
        cfg = OmegaConf.structured(copy.deepcopy(self.typed_config()))
        OmegaConf.set_readonly(cfg, True)
        return cfg


def decided_config(cfg: Config, world_size: int, checkpoint: CheckpointPlan) -> tuple[dict[str, Any], str, Any]:
    """The job's config with the parent's decisions in place of what they resolve (the world
    size, the checkpoint directory, format and resume): as plain data, options by name
    (``JobSpec.config``), as Hydra writes it, interpolations kept (``JobSpec.config_yaml``),
    and typed (``JobSpec.typed``). ``cfg`` must be pre-flight's own copy: its values are set."""
    cfg.trainer.world_size = world_size
    for key, value in checkpoint.config_values().items():
        cfg.trainer[key] = value
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), OmegaConf.to_yaml(cfg), typed(cfg)


def this_process() -> dict:
    """The spec's fields that name the process that checked (the parent's): its SHARDED_EXP_*
    variables, its pid and its job logging."""
    return {
        "env": {k: v for k, v in os.environ.items() if k.startswith("SHARDED_EXP_")},
        "parent_pid": os.getpid(),
        "log_file": logs.job_log_file(),
        "log_level": logs.level(),
    }
