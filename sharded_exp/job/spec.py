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
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.config import Config, typed
from sharded_exp.strategies.base import GradZeroing


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

    def cfg(self) -> DictConfig:
        """``typed`` as a read-only OmegaConf tree: what the ranks read, typed as the composed
        config is (the schemas' enums), with attribute and key access alike."""
        cfg = OmegaConf.structured(copy.deepcopy(self.typed))
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
