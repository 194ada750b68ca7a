"""Typed schemas behind every config group, registered in Hydra's ConfigStore.

Each YAML file in ``conf/<group>/`` starts its defaults list with its schema, stored by
:func:`register_schemas` as ``<group>/<kind>_schema``, so a typo in a key or a value of
the wrong type fails when Hydra composes the config, before any rank is started.  Checks that a type cannot express (``world_size >= 1``, a GPU that exists)
live in :func:`validate`, which the launcher runs once in the parent process.

Every field is documented right under it; the same names appear in ``result.json``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that composes but cannot run; the message names value and choices."""


# -------------------------------------------------------------------------- precision
@dataclass
class PrecisionConfig:
    name: str = "32"
    """32: no autocast. 16: float16 autocast + dynamic loss scaling. bf16: bfloat16 autocast."""
    init_scale: float = 2.0**16
    """Initial loss scale for precision=16 (torch default 2**16)."""
    growth_interval: int = 2000
    """Steps without inf/nan before the loss scale is doubled (torch default 2000)."""
    backoff_factor: float = 0.5
    """Factor applied to the loss scale when an inf/nan gradient is found (torch default)."""


# -------------------------------------------------------------------------- optimizer
@dataclass
class OptimizerConfig:
    name: str = MISSING
    """adam, adamw or sgd (torch.optim classes)."""
    lr: float = 1e-3
    """Learning rate of the weight group (2-D weights)."""
    weight_decay: float = 0.0
    """Weight decay, applied to the weight group only (biases, norms, embeddings' none)."""
    no_decay_lr_scale: float = 1.0
    """Learning rate of the second group (biases and norm gains) as a multiple of lr."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum (buffers count as optimizer state)."""


# ---------------------------------------------------------------------------- trainer
class Accelerator(str, Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


@dataclass
class TrainerConfig:
    world_size: int = 2
    """Ranks to start (ignored when launched by torchrun/SLURM, which set the ranks)."""
    accelerator: Accelerator = Accelerator.auto
    """auto (GPU if CUDA is available), cpu (gloo) or gpu (NCCL, one GPU per rank)."""
    steps: int = 30
    """Optimizer steps to run."""
    warmup_steps: int = 5
    """First steps excluded from timing (allocator warm-up, lazy init)."""
    batch_size: int = 32
    """Samples per rank per micro-batch; the global batch is batch_size*grad_accum*world_size."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient sync only on the last one)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 turns clipping off."""
    seed: int = 0
    """Seed of model initialisation and batch sampling."""
    log_interval: int = 10
    """Steps between synced metric logs (loss, accuracy/perplexity)."""
    progress_bar: bool = True
    """tqdm progress bar on rank 0."""
    timeout_s: float = 300.0
    """Collective timeout: a rank that does not arrive within it ends the job."""
    memory_limit_mib: Optional[float] = None
    """Per-rank memory budget: on CUDA a cap on the caching allocator, on CPU an
    out-of-memory error when tracked live tensors exceed it. null = no budget."""
    save_final_state: bool = False
    """Write the full (unsharded) final model state to model_final.pt on rank 0."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps and at the end (and on SIGTERM/SIGINT);
    0 = no checkpoints."""
    checkpoint_dir: Optional[str] = None
    """Where checkpoints go and where resume=auto looks; null = <output dir>/checkpoints."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints; 0 = keep all."""
    resume: Optional[str] = None
    """null: start fresh. auto: from the newest complete checkpoint in checkpoint_dir, if
    there is one. A path: from that checkpoint directory (e.g. .../checkpoints/step_00000020)."""
    stop_grace_s: float = 60.0
    """After SIGTERM/SIGINT, seconds the ranks get to stop together and save a checkpoint
    before they are killed (SLURM waits KillWait, 30 s by default, before SIGKILL)."""


@dataclass
class LoggerConfig:
    name: str = "none"
    """none or wandb."""
    mode: Optional[str] = None
    """W&B mode: offline, online or disabled; null means $WANDB_MODE if set, else offline."""
    project: str = "sharded_exp"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); null uses the default of the logged-in account."""
    group: Optional[str] = None
    """W&B group; null means the sweep id (multirun) or run id, filled in by the job."""
    job_type: Optional[str] = None
    """W&B job type; null means the strategy name."""
    run_name: Optional[str] = None
    """W&B run name; null means the job's overrides."""
    tags: List[str] = field(default_factory=list)
    """W&B tags."""
    init_timeout_s: float = 15.0
    """Seconds W&B may take to start before the job gives up on it and trains on."""


@dataclass
class PlanConfig:
    params: Optional[float] = None
    """Plan for a raw parameter count (e.g. 7.5e9) instead of the configured model."""
    world_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 64])
    """World sizes to plan for."""
    device_memory_gib: float = 80.0
    """Memory per device; rows that fit are marked."""
    largest_world_size: int = 8
    """World size for the "largest model that fits" search (by depth at the model's width)."""
    format: str = "table"
    """table or json."""


# ------------------------------------------------------------------------------- root
@dataclass
class Config:
    strategy: Any = MISSING
    precision: PrecisionConfig = MISSING
    model: Any = MISSING
    optimizer: OptimizerConfig = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = MISSING
    logger: Any = MISSING
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Settings of ``python -m sharded_exp.plan`` (unused by training)."""
    experiment: Optional[str] = None
    """Name of the experiment preset, if one was chosen (set by the preset)."""


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore as ``<group>/<kind>_schema``.

    The fixed groups' schemas live in this module; strategies, models and data tasks bring
    their own next to their builders (one module + one YAML file adds one), so they are
    read from the registries here.
    """
    from sharded_exp.data import TASKS
    from sharded_exp.models import MODELS
    from sharded_exp.strategies import STRATEGIES

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="precision", name="precision_schema", node=PrecisionConfig)
    cs.store(group="optimizer", name="optimizer_schema", node=OptimizerConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    for group, registry in (("strategy", STRATEGIES), ("model", MODELS), ("data", TASKS)):
        for name in registry.names():
            cs.store(group=group, name=f"{name}_schema", node=registry.config_class(name))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg) -> int:
    """Checks a schema cannot express, run once in the parent before any rank starts.

    Builds the model on the meta device (no memory) to catch shape errors and to count
    parameters, which it returns.
    """
    import torch

    from sharded_exp import faults
    from sharded_exp.data import TASKS
    from sharded_exp.models import MODELS, build_model
    from sharded_exp.optim import OPTIMIZERS
    from sharded_exp.precision import PRECISIONS
    from sharded_exp.strategies import STRATEGIES

    t = cfg.trainer
    try:
        faults.from_env()  # a malformed testing aid fails here, not in every rank
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    STRATEGIES.builder(cfg.strategy.name)  # raises, naming the registered ones
    MODELS.builder(cfg.model.name)
    TASKS.builder(cfg.data.name)
    _require(
        cfg.precision.name in PRECISIONS, f"precision={cfg.precision.name!r} is not one of {', '.join(PRECISIONS)}"
    )
    _require(
        cfg.optimizer.name in OPTIMIZERS, f"optimizer.name={cfg.optimizer.name!r} is not one of {', '.join(OPTIMIZERS)}"
    )
    for key in ("world_size", "steps", "batch_size", "grad_accum", "log_interval"):
        _require(t[key] >= 1, f"trainer.{key}={t[key]} must be >= 1")
    _require(
        0 <= t.warmup_steps < t.steps,
        f"trainer.warmup_steps={t.warmup_steps} must be >= 0 and < trainer.steps={t.steps} "
        "(steps after warm-up are the timed ones)",
    )
    _require(t.grad_clip >= 0, f"trainer.grad_clip={t.grad_clip} must be >= 0 (0 turns clipping off)")
    _require(t.timeout_s > 0, f"trainer.timeout_s={t.timeout_s} must be > 0")
    _require(t.checkpoint_every >= 0, f"trainer.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = off)")
    _require(t.keep_checkpoints >= 0, f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0 = keep all)")
    _require(t.stop_grace_s > 0, f"trainer.stop_grace_s={t.stop_grace_s} must be > 0")
    _require(
        t.memory_limit_mib is None or t.memory_limit_mib > 0,
        f"trainer.memory_limit_mib={t.memory_limit_mib} must be > 0 (or null for no budget)",
    )
    _require(cfg.optimizer.lr > 0, f"optimizer.lr={cfg.optimizer.lr} must be > 0")
    accelerator = str(t.accelerator.value if isinstance(t.accelerator, Enum) else t.accelerator)
    if accelerator == "gpu":
        _require(
            torch.cuda.is_available(),
            "trainer.accelerator=gpu but CUDA is not available here; use trainer.accelerator=cpu or auto",
        )
        gpus = torch.cuda.device_count()
        _require(
            t.world_size <= gpus,
            f"trainer.world_size={t.world_size} is more than the {gpus} GPU(s) present "
            "(one rank per GPU); lower it or use trainer.accelerator=cpu",
        )
    uses_cuda = accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available())
    if uses_cuda and cfg.precision.name == "bf16":
        _require(torch.cuda.is_bf16_supported(), "precision=bf16 is not supported by this GPU; use 16 or 32")
    with torch.device("meta"):
        model = build_model(cfg.model)
    TASKS.builder(cfg.data.name)(cfg.data, cfg.model, t.batch_size)  # checks model/data match
    return sum(p.numel() for p in model.parameters())


def resolve_checkpoints(cfg, output_dir: str) -> None:
    """Fill in ``trainer.checkpoint_dir`` and turn ``trainer.resume`` into a checkpoint path
    (or null), checking that the checkpoint is complete, readable and fits this job.

    Runs in the parent before any rank starts; raises ConfigError naming the file.
    """
    import torch

    from sharded_exp import checkpoint
    from sharded_exp.models import build_model

    t = cfg.trainer
    t.checkpoint_dir = os.path.abspath(t.checkpoint_dir or os.path.join(output_dir, "checkpoints"))
    try:
        t.resume = checkpoint.resolve_resume(t.resume, t.checkpoint_dir)
        if t.resume is None:
            return
        meta = checkpoint.read_meta(t.resume)
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in build_model(cfg.model).state_dict().items()}
        checkpoint.check_compatible(t.resume, meta, shapes, cfg.optimizer.name, t.steps)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(str(exc)) from None


CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf")


def quote_numeric_choices(args: list[str], conf_dir: str = CONF_DIR) -> list[str]:
    """Let ``precision=16`` (and sweeps like ``precision=32,16``) name a config group option.

    Hydra parses an unquoted ``16`` as an int and refuses it as a group choice, so a user
    would have to type ``precision="'16'"``. Numeric choices of config groups are quoted
    here before Hydra parses the command line; everything else passes through unchanged.
    """
    out = []
    for arg in args:
        m = re.fullmatch(r"([+~]{0,2}[\w/]+)=([\w.,]+)", arg)
        if m and os.path.isdir(os.path.join(conf_dir, m.group(1).lstrip("+~"))):
            items = m.group(2).split(",")
            arg = m.group(1) + "=" + ",".join(f"'{v}'" if re.fullmatch(r"[0-9.]+", v) else v for v in items)
        out.append(arg)
    return out
