"""Typed schemas behind every config group: dataclasses, nothing else.

Each YAML file in ``conf/<group>/`` starts its defaults list with its schema (stored in
Hydra's ConfigStore by :func:`sharded_exp.compose.register_schemas`), so a typo in a key
or a value of the wrong type fails when Hydra composes the config. A default lives here,
in its dataclass, and nowhere else: a YAML file names its option and sets only what
differs. Strategies, models and tasks keep their schemas beside their builders.

Every field is documented right under it; the same names appear in ``result.json``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from sharded_exp.errors import ConfigError, missing_packages


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(value) -> bool:
    """A plain comparison lets inf and nan through: a number must also be finite."""
    return isinstance(value, (int, float)) and math.isfinite(value)


class Sealed:
    """A schema whose instances :func:`typed` makes are read-only: the typed config the JobSpec
    carries to the ranks cannot be changed on the way (set a value in the DictConfig before
    :func:`typed`, or make a changed copy with :func:`dataclasses.replace`).

    Not ``@dataclass(frozen=True)``: Hydra refuses every command-line override of a frozen
    schema's fields ("Cannot change read-only config container"), so a schema is built mutable
    and sealed once built (:func:`seal`). Every schema derives from this (a test holds it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: a typed config is read-only once made "
                "(change the DictConfig before typed(), or copy it with dataclasses.replace)"
            )
        object.__setattr__(self, name, value)


def seal(obj: Any) -> Any:
    """Seal ``obj`` and every schema inside it (fields, lists, dicts); returns ``obj``."""
    if isinstance(obj, Sealed):
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            seal(getattr(obj, f.name))
        object.__setattr__(obj, "_sealed", True)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            seal(value)
    elif isinstance(obj, dict):
        for value in obj.values():
            seal(value)
    return obj


# -------------------------------------------------------------------------- precision
@dataclass
class PrecisionConfig(Sealed):
    name: str = "32"
    """32: no autocast. 16: float16 autocast + dynamic loss scaling. bf16: bfloat16 autocast."""
    init_scale: float = 2.0**16
    """Initial loss scale for precision=16 (torch default 2**16)."""
    growth_interval: int = 2000
    """Steps without inf/nan before the loss scale is doubled (torch default 2000)."""
    backoff_factor: float = 0.5
    """Factor applied to the loss scale when an inf/nan gradient is found (torch default)."""

    def __post_init__(self) -> None:
        """The grad scaler's settings, checked when the config is made typed (:func:`typed`)."""
        scale = self.init_scale
        _require(_finite(scale) and scale > 0, f"precision.init_scale={scale} must be > 0")
        _require(
            _finite(self.backoff_factor) and 0 < self.backoff_factor < 1,
            f"precision.backoff_factor={self.backoff_factor} must be in (0, 1)",
        )
        _require(self.growth_interval >= 1, f"precision.growth_interval={self.growth_interval} must be >= 1")


# -------------------------------------------------------------------------- optimizer
@dataclass
class OptimizerConfig(Sealed):
    name: str = MISSING
    """adam, adamw or sgd (torch.optim classes)."""
    lr: float = 1e-3
    """Learning rate of the weight group (2-D weights)."""
    weight_decay: float = 0.0
    """Weight decay, applied to the weight group only: parameters of two or more dimensions
    (matrices, embeddings); biases and norm gains (one dimension) get none."""
    no_decay_lr_scale: float = 1.0
    """Learning rate of the second group (biases and norm gains) as a multiple of lr."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum (buffers count as optimizer state)."""
    foreach: Optional[bool] = None
    """Step each parameter group with torch's foreach kernels (true: one kernel per group,
    with temporaries as large as the group's state) or one tensor at a time (false: what
    optimizers written before them did, e.g. transformers' AdamW of 2020). null: torch's own
    choice for the parameters' device, foreach on CUDA and per tensor on CPU."""

    def __post_init__(self) -> None:
        """Every number in range and finite (the name is checked against the registry in pre-flight)."""
        _require(_finite(self.lr), f"optimizer.lr={self.lr} must be a finite number")
        _require(self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        for key in ("weight_decay", "no_decay_lr_scale"):
            value = getattr(self, key)
            _require(_finite(value) and value >= 0, f"optimizer.{key}={value} must be a finite number >= 0")
        _require(_finite(self.eps) and self.eps > 0, f"optimizer.eps={self.eps} must be a finite number > 0")
        _require(
            _finite(self.momentum) and 0 <= self.momentum < 1, f"optimizer.momentum={self.momentum} must be in [0, 1)"
        )
        betas = list(self.betas)
        _require(
            len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas),
            f"optimizer.betas={betas} must be two numbers in [0, 1) (e.g. [0.9, 0.999])",
        )


# ---------------------------------------------------------------------------- trainer
class Option(str, Enum):
    """A config option: a member reads as its name wherever a string is wanted (``str()``, an
    f-string), so code reads a composed config's members and a plain name alike, without a
    conversion at each use. Every schema's choices derive from it."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Accelerator(Option):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class CheckpointFormat(Option):
    auto = "auto"
    dcp = "dcp"
    consolidated = "consolidated"


class ExistingCheckpoints(Option):
    refuse = "refuse"
    archive = "archive"


class ActivationCheckpointing(Option):
    none = "none"
    full = "full"
    selective = "selective"
    selective_op = "selective_op"


class CompileMode(Option):
    default = "default"
    reduce_overhead = "reduce_overhead"
    max_autotune = "max_autotune"
    max_autotune_no_cudagraphs = "max_autotune_no_cudagraphs"


class ZeroGrad(Option):
    free = "free"
    zeros = "zeros"


@dataclass(frozen=True)
class GradZeroing:
    """How a strategy clears gradients at the start of each step: the rule
    ``trainer.zero_grad`` asked for, the rule the strategy applies, and why they differ."""

    requested: ZeroGrad
    applied: ZeroGrad
    reason: str = ""
    """Empty when ``applied`` is ``requested``."""

    @property
    def set_to_none(self) -> bool:
        return self.applied is ZeroGrad.free

    def record(self) -> dict[str, Any]:
        """result.json's ``zero_grad``."""
        return {"requested": self.requested.value, "applied": self.applied.value, "reason": self.reason or None}


class MmapThreshold(Option):
    reuse = "reuse"
    dynamic = "dynamic"
    fixed = "fixed"


class MemorySnapshot(Option):
    auto = "auto"
    oom = "oom"
    always = "always"
    off = "off"


def option_name(value) -> str | None:
    """A config option by its name, None for None: an :class:`Option` member or a plain name
    (a number, for precision=16 written without quotes) alike."""
    return None if value is None else str(value.value if isinstance(value, Enum) else value)


@dataclass
class TrainerConfig(Sealed):
    world_size: int = 2
    """Ranks to start (ignored when launched by torchrun/SLURM, which set the ranks)."""
    accelerator: Accelerator = Accelerator.auto
    """auto (GPU if CUDA is available), cpu (gloo) or gpu (NCCL, one GPU per rank)."""
    steps: int = 35
    """Optimizer steps to run."""
    warmup_steps: int = 5
    """First steps excluded from timing (allocator warm-up, lazy init)."""
    min_timed_steps: int = 30
    """Timed steps (after warm-up) a stable median needs: fewer are warned of before the run and
    named in a sweep's report (their speed intervals are wide). 30 is measured
    (``python -m benchmarks.accuracy.timed_steps``): the median step's 95% interval within +-5% for the
    GPT at 2 ranks, ddp and fsdp, on 2 shared CPU cores; 0 turns the check off."""
    batch_size: int = 32
    """Samples per rank per micro-batch; the global batch is batch_size*grad_accum*world_size."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient sync only on the last one)."""
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    """Recompute activations in the backward instead of keeping them, per unit of the model
    (its blocks), before the strategy wraps it: none; full (a unit keeps only its inputs);
    selective (a unit keeps the outputs of its matmuls and attention, recomputes the rest);
    selective_op (torchtitan's per-op policy: as selective, but every second matmul of a
    unit is recomputed too)."""
    ac_every: int = 1
    """Checkpoint every N-th unit (1: every unit)."""
    compile: bool = False
    """torch.compile each unit of the model before the strategy wraps it (as torchtitan
    does); the first step's extra time is reported as compile_s, outside the timed steps."""
    compile_mode: CompileMode = CompileMode.default
    """torch.compile's mode (reduce_overhead = "reduce-overhead", and so on)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 turns clipping off."""
    zero_grad: ZeroGrad = ZeroGrad.free
    """How each step clears the last step's gradients: free (``set_to_none=True``, torch's
    default since 2.0: their memory is released until the backward makes new ones) or zeros
    (``set_to_none=False``, torch's default before 2.0: they stay allocated as zero tensors
    through the next forward, so the peak holds them beside the activations). The memory
    prediction fakes the same rule. A strategy that must clear them its own way applies its
    own rule (sharded_ddp always zeros in place): result.json's ``zero_grad`` records the
    rule asked for, the rule applied and why they differ."""
    seed: int = 0
    """Seed of model initialisation and batch sampling."""
    log_interval: int = 10
    """Steps between synced metric logs (loss, accuracy/perplexity)."""
    eval_every: int = 0
    """Steps between evaluation passes (held-out batches, untimed; torchmetrics' definitions); 0 = only
    at the end. Inside the CPU memory tracker's window (the warm-up steps) none runs."""
    eval_batches: int = 4
    """Held-out batches per rank in each evaluation pass; 0 turns evaluation off."""
    progress_bar: bool = True
    """Progress on rank 0: a tqdm bar on a terminal; elsewhere (a log file, SLURM, CI) a plain
    line every trainer.log_interval steps."""
    timeout_s: float = 300.0
    """Collective timeout: a rank that does not arrive within it ends the job."""
    memory_limit_mib: Optional[float] = None
    """Per-rank memory budget: on CUDA a cap on the caching allocator, on CPU an
    out-of-memory error when tracked live tensors exceed it. null = no budget."""
    memory_snapshot: MemorySnapshot = MemorySnapshot.auto
    """CUDA: record the caching allocator's history (torch's ``_record_memory_history``) and
    dump it to memory_snapshot_rank<r>.pickle in the run directory (open it at
    https://pytorch.org/memory_viz). auto: recorded when memory_limit_mib is set, dumped on
    out-of-memory; oom: recorded always, dumped on out-of-memory; always: also dumped at the
    end of a run; off. Recording costs step time (benchmarks/features/memory_history_cost.py). CPU runs
    record nothing: their out-of-memory breakdown is memory.oom_breakdown in result.json."""
    profile: bool = False
    """Write a torch.profiler trace (trace_rank<r>.json, for https://ui.perfetto.dev) of
    profile_steps steps right after warm-up; those steps are not timed."""
    profile_steps: int = 3
    """Steps profiled when profile=true."""
    host_mmap_threshold: MmapThreshold = MmapThreshold.reuse
    """CPU ranks' host malloc, glibc's (sharded_exp/measure/host_malloc.py). reuse (the default):
    blocks up to 32 MiB come from the heap, which is never trimmed, so each step reuses the
    last one's pages and faults in none (PyTorch's CPU tuning guide asks the same of an
    allocator); larger blocks are mapped anew, and the time model prices their pages (an upper
    bound: the heap's free top can serve one).
    dynamic: glibc's own rule, as your own script gets it: the heap's top is given back and
    faulted in again (1,000-3,100 pages a step for a gpt small rank, unpriced). fixed: the mmap
    threshold at 4 MiB, so a freed block of 4 MiB or more goes back to the kernel and a CPU
    rank's resident memory is close to what its tensors hold; such blocks are new pages every
    time a step makes them (a 1024-wide MLP's steps 26-38% longer, hf_gpt2's 39-101%, in
    docs/figures.md). Under reuse and dynamic
    the heap keeps freed blocks resident (``heap_free_mib``; a FSDP rank's freed gathers among
    them, which can make its ``peak_rss_mib`` several times its tracked peak:
    docs/concepts/memory.md), which trainer.host_memory_check does not count. Every strategy
    runs under the same rule. A ``MALLOC_*_`` setting of glibc's or a ``glibc.malloc`` tunable in
    the environment overrides them all."""
    host_memory_check: bool = True
    """Refuse a job whose predicted host memory (all ranks on this machine, plus each process's
    own) exceeds what is available here, before any rank steps (the model states before any
    starts; the command's ranks start while the peak is predicted, and wait for it): on CPU
    every tensor's peak; on a GPU, CPU offload's states as torch pins and holds them, before
    any rank starts (sharded_exp/predict/host_memory.py)."""
    save_final_state: bool = False
    """Write the full (unsharded) final model state to model_final.pt on rank 0."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps and at the end (and on SIGTERM/SIGINT);
    0 = no checkpoints."""
    checkpoint_dir: Optional[str] = None
    """Where checkpoints go and where resume=auto looks; null = <output dir>/checkpoints."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints; 0 = keep all."""
    checkpoint_format: CheckpointFormat = CheckpointFormat.auto
    """dcp: torch.distributed.checkpoint, each rank writes and reads only its own shards.
    consolidated: full model.pt / optim.pt written by rank 0 (for exchange). auto: dcp for
    every strategy that shards something, consolidated for ddp."""
    existing_checkpoints: ExistingCheckpoints = ExistingCheckpoints.refuse
    """When checkpoint_dir already holds checkpoints later than the step this run starts
    from (another trajectory: a fresh run, or a resume from an earlier step): refuse the
    job before it starts, or archive them to checkpoint_dir/archived/<n>/ first. Never
    kept beside this run's (resume=auto would then continue the other trajectory)."""
    checkpoint_async: bool = False
    """dcp only: write the checkpoint files in the background while training goes on."""
    resume: Optional[str] = None
    """null: start fresh. auto: from the newest complete checkpoint in checkpoint_dir, if
    there is one. A path: from that checkpoint directory (e.g. .../checkpoints/step_00000020)."""
    stop_grace_s: float = 60.0
    """After SIGTERM/SIGINT, seconds the ranks get to stop together and save a checkpoint
    before they are killed (SLURM waits KillWait, 30 s by default, before SIGKILL). Also how
    long spawned ranks that all finished get to exit before they are killed (their results kept),
    and ranks started by torchrun or srun get to tear down before they exit with code 1."""
    freeze: List[str] = field(default_factory=list)
    """Parameters not trained, as in fine-tuning: names (``model.named_parameters()``)
    matching one of these shell patterns, e.g. ``[embed.*]`` or ``["transformer.wte.*"]``,
    get ``requires_grad=False``, hence no gradient and no optimizer state. A pattern
    that matches nothing is an error."""

    def __post_init__(self) -> None:
        """Counts, ranges, then finiteness (a nan fails its range first, as it always did)."""
        for key in ("world_size", "steps", "batch_size", "grad_accum", "log_interval", "ac_every", "profile_steps"):
            value = getattr(self, key)
            _require(value >= 1, f"trainer.{key}={value} must be >= 1")
        _require(
            0 <= self.warmup_steps < self.steps,
            f"trainer.warmup_steps={self.warmup_steps} must be >= 0 and < trainer.steps={self.steps} "
            "(steps after warm-up are the timed ones)",
        )
        _require(
            self.min_timed_steps >= 0, f"trainer.min_timed_steps={self.min_timed_steps} must be >= 0 (0: no check)"
        )
        _require(
            not self.profile or self.warmup_steps + self.profile_steps < self.steps,
            f"trainer.profile_steps={self.profile_steps} needs trainer.steps={self.steps} > trainer.warmup_steps="
            f"{self.warmup_steps} + profile_steps (profiled steps come after warm-up and are not timed)",
        )
        _require(self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip} must be >= 0 (0 turns clipping off)")
        _require(self.timeout_s > 0, f"trainer.timeout_s={self.timeout_s} must be > 0")
        _require(self.eval_every >= 0, f"trainer.eval_every={self.eval_every} must be >= 0 (0 = only at the end)")
        _require(self.eval_batches >= 0, f"trainer.eval_batches={self.eval_batches} must be >= 0 (0 = no evaluation)")
        _require(self.checkpoint_every >= 0, f"trainer.checkpoint_every={self.checkpoint_every} must be >= 0 (0 = off)")
        _require(
            self.keep_checkpoints >= 0, f"trainer.keep_checkpoints={self.keep_checkpoints} must be >= 0 (0 = keep all)"
        )
        _require(self.stop_grace_s > 0, f"trainer.stop_grace_s={self.stop_grace_s} must be > 0")
        _require(
            self.memory_limit_mib is None or self.memory_limit_mib > 0,
            f"trainer.memory_limit_mib={self.memory_limit_mib} must be > 0 (or null for no budget)",
        )
        for key in ("grad_clip", "timeout_s", "stop_grace_s", "memory_limit_mib"):
            value = getattr(self, key)
            _require(value is None or _finite(value), f"trainer.{key}={value} must be a finite number")


# ----------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig(Sealed):
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


# ------------------------------------------------------------------------------ paths
@dataclass
class PathsConfig(Sealed):
    output_dir: str = "outputs"
    """Where jobs write: a run in ``<output_dir>/runs/<time>``, a sweep in
    ``<output_dir>/multirun/<time>``, a job under torchrun or SLURM in
    ``<output_dir>/runs/torchrun-<id>`` / ``slurm-<job>.<step>``. Relative to the working
    directory. ``hydra.run.dir`` / ``hydra.sweep.dir`` still choose one directory exactly."""
    data_dir: str = "data"
    """Where your data files live, for the data settings to name:
    ``data.path='${paths.data_dir}/train.conll'``. Nothing is read from it unless a setting
    names it; relative to the working directory."""


# ----------------------------------------------------------------------------- report
@dataclass
class ReportConfig(Sealed):
    """What a sweep's report adds to its measured figures (the report reads it from its points'
    result.json, so ``python -m sharded_exp.report`` says the same later)."""

    device_profile: Optional[str] = None
    """A named GPU profile (v100_32gb, a100_40gb, a100_80gb, h100_sxm, h100_hbm2e_500w, h200;
    sharded_exp/speed/profile_data) to plan each CPU point's speed on: the headline then puts
    the planned ratio beside the measured one, since a CPU's speed ratios (gloo on shared cores)
    are not a GPU's. Priced by the planner's time model at the point's own world size
    (plan.gpus_per_node and plan.inter_node_gbps at their defaults); one fake step per strategy.
    null: measured figures only."""

    def __post_init__(self) -> None:
        if self.device_profile is None:
            return
        # lazy: the profile files are read only when a profile is named
        from sharded_exp.speed.profiles import device_names

        names = device_names()
        _require(
            self.device_profile in names,
            f"report.device_profile={self.device_profile} is not a named GPU profile; "
            f"use one of {', '.join(names)} (or null)",
        )


# ------------------------------------------------------------------------- the roots
@dataclass
class JobGroups(Sealed):
    """The config groups a job is made of, shared by training and the planner."""

    strategy: Any = MISSING
    precision: PrecisionConfig = MISSING
    model: Any = MISSING
    optimizer: OptimizerConfig = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = MISSING


@dataclass
class Config(JobGroups):
    """``conf/config.yaml``: ``python -m sharded_exp``."""

    logger: Any = MISSING
    paths: PathsConfig = MISSING
    report: ReportConfig = field(default_factory=ReportConfig)
    """What a sweep's report adds (``report.device_profile``)."""
    experiment: Optional[str] = None
    """Name of the experiment preset, if one was chosen (set by the preset)."""
    hparams_search: Optional[str] = None
    """Name of the hyperparameter search preset (``conf/hparams_search``), if one was chosen
    (set by the preset)."""
    debug: Optional[str] = None
    """Name of the debugging preset (``conf/debug``: ``debug=fast``), if one was chosen (set by
    the preset)."""
    objective: Optional[str] = None
    """The result.json number ``main`` returns, for Hydra's optimizing sweepers (Optuna):
    e.g. ``throughput/samples_per_s``; a leading ``-`` negates it
    (``-memory/peak_allocated_mib_max``). A failed or out-of-memory point returns the worst
    value for the sweeper's direction. null: main returns nothing. See sharded_exp.sweep."""


# ------------------------------------------------------------------- root: the planner
class PlanFind(Option):
    batch_size = "batch_size"
    depth = "depth"
    fastest = "fastest"


class PlanFormat(Option):
    table = "table"
    md = "md"
    csv = "csv"
    json = "json"


class PlanColumns(Option):
    short = "short"
    all = "all"


class PlanDevice(Option):
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class PlanSettings(Sealed):
    params: Optional[float] = None
    """Plan for a raw parameter count (e.g. 7.5e9) instead of the configured model."""
    units: int = 32
    """Blocks a raw parameter count is split into (FSDP gathers one at a time)."""
    world_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 64])
    """World sizes to plan for."""
    by_depth: bool = True
    """A model of identical blocks is faked at three shallow depths and its peak composed
    at its own depth (sharded_exp/plan/depth.py: seconds instead of minutes for an
    80-layer model); false: fake the whole model."""
    strategies: Optional[List[str]] = None
    """Strategies to plan for (null: every registered one)."""
    device_memory_gib: float = 80.0
    """Memory per device; rows that fit are marked."""
    host_memory_gib: Optional[float] = None
    """Host memory per node that CPU offload's states are held against (an offloaded row fits
    only if its node's ``host_node`` figure fits here too). null: the server's memory in
    ``plan.device_profile``'s file (a DGX H100's 2,048 GiB), or this machine's for ``this``;
    a profile that states none leaves the host unchecked, said in the row's note."""
    levers: List[str] = field(default_factory=lambda: ["none"])
    """Lever combinations planned for each strategy: none, ac (full activation
    checkpointing), ac_selective, ac_selective_op (torchtitan's per-op selective policy),
    offload (FSDP's CPU offload: fsdp, fsdp_grad_op only),
    joined with + (``[none,ac,ac+offload]``). The output names the cheapest combination that
    fits per world size (DDP < ZeRO-1 < ZeRO-2 < FSDP < + AC < + offload) and its cost."""
    device: PlanDevice = PlanDevice.cuda
    """The device planned for: ``cuda`` fakes the step with the kernels CUDA would choose
    (fused attention, foreach optimizer) plus cuBLAS's workspace, on any machine, without
    a GPU; ``cpu`` fakes a CPU run's kernels (what a run on this CPU measures)."""
    find: Optional[PlanFind] = None
    """Also find the largest ``batch_size`` (per rank) or GPT ``depth`` that fits, per
    strategy and world size; or the ``fastest`` configuration that fits per world size
    (strategy x lever x per-rank batch at the fixed global batch, trainer.grad_accum making up
    the rest, x HSDP replicate), with the command line that runs it."""
    device_profile: Optional[str] = None
    """The device the speed columns are predicted for: a named GPU profile (v100_32gb,
    a100_40gb, a100_80gb, h100_sxm, h100_hbm2e_500w, h200; sharded_exp/speed/profile_data) or ``this`` (this
    machine, measured). null: h100_sxm for plan.device=cuda, this for cpu (said in the header)."""
    gpus_per_node: int = 8
    """GPUs per node: ranks within a node talk over the profile's NVLink, nodes (world size /
    this) over the network."""
    inter_node_gbps: float = 100.0
    """The network between nodes, in Gb/s per GPU, one direction (InfiniBand or RoCE; eight
    GPUs sharing two 100 Gb/s NICs: 25)."""
    remeasure: bool = False
    """Measure the ``this`` profile again (it is cached per machine in the user cache dir)."""
    workers: int = 0
    """Processes that fake steps side by side, one strategy (and lever combination) each:
    0 (default) one per CPU core for a model of 1e8 parameters or more, at most one per
    strategy; 1: all in this process."""
    format: PlanFormat = PlanFormat.table
    """table (aligned), md (a Markdown table), csv (GiB) or json: the same columns."""
    columns: PlanColumns = PlanColumns.short
    """What ``plan.format=table`` shows: ``short``, the columns that fit 100 characters a
    line (short headings, the most telling columns first; the line under the table names
    those left out) and the header and notes wrapped at 100; ``all``: every column under its
    full heading, on lines as long as they come. md, csv and json always hold every column."""
    plot: Optional[str] = None
    """Also draw the plan into this PNG file: the peak per rank vs world size, a line per
    strategy (and lever combination), the device memory as a line (null: no chart)."""
    alloc_conf: Optional[str] = None
    """The CUDA caching allocator's settings a ``plan.device=cuda`` plan models, as
    ``PYTORCH_CUDA_ALLOC_CONF`` spells them (``expandable_segments:True``,
    ``max_split_size_mb:512``, ...; "" : torch's defaults); null: the variable from this
    environment, as a run's ranks would inherit it. A CPU plan has no caching allocator."""

    def __post_init__(self) -> None:
        """The settings checked on their own; those that need the planner's limits or the
        command line are checked by :func:`sharded_exp.plan.command.check_plan`."""
        _require(
            self.params is None or (_finite(self.params) and self.params >= 1),
            f"plan.params={self.params} must be a finite number >= 1 (a parameter count, e.g. 7.5e9)",
        )
        _require(
            _finite(self.device_memory_gib) and self.device_memory_gib > 0,
            f"plan.device_memory_gib={self.device_memory_gib} must be a finite number > 0",
        )
        _require(
            self.host_memory_gib is None or (_finite(self.host_memory_gib) and self.host_memory_gib > 0),
            f"plan.host_memory_gib={self.host_memory_gib} must be a finite number > 0, or null (the profile's server)",
        )
        _require(self.gpus_per_node >= 1, f"plan.gpus_per_node={self.gpus_per_node} must be >= 1")
        _require(
            _finite(self.inter_node_gbps) and self.inter_node_gbps > 0,
            f"plan.inter_node_gbps={self.inter_node_gbps} must be a finite number of Gb/s > 0",
        )
        _require(
            self.workers >= 0,
            f"plan.workers={self.workers} must be >= 0 (0: one process per CPU core; 1: this process only)",
        )
        if self.device_profile is not None:
            # lazy: the profile files are read only when a profile is named
            from sharded_exp.speed.profiles import device_names

            names = [*device_names(), "this"]
            _require(
                self.device_profile in names,
                f"plan.device_profile={self.device_profile} is not a device profile; use one of {', '.join(names)} "
                "(or null: h100_sxm for plan.device=cuda, this for cpu)",
            )


@dataclass
class PlanConfig(JobGroups):
    """``conf/plan.yaml``: ``python -m sharded_exp.plan``. The same groups as training
    (the model, precision, optimizer and per-rank batch are planned for) plus ``plan``."""

    plan: PlanSettings = field(default_factory=PlanSettings)


def typed(cfg: DictConfig) -> JobGroups:
    """The composed config as its schemas' dataclasses: the one place a config becomes typed.

    OmegaConf checks keys and types when Hydra composes, but calls no ``__post_init__``;
    ``OmegaConf.to_object`` builds each group's dataclass, and so runs each group's own range
    checks (a :class:`~sharded_exp.errors.ConfigError` naming the value and what is allowed).
    Pre-flight calls it on the decided config (the JobSpec's ``typed``), before any rank starts.
    The objects are sealed (:class:`Sealed`): read-only from here to the ranks."""
    return seal(OmegaConf.to_object(cfg))


def check_ranges(cfg: DictConfig, world_size: int | None = None) -> None:
    """Each group's own range checks, run by making the group typed (:func:`typed`), then
    the bounds its schema declares (:func:`check_bounds`: the registries' strategy, model and
    data schemas, whose classes live beside their builders) and a model's sizes
    (:func:`check_model_sizes`), whether the data task feeds the model (:func:`check_fed`) and
    whether the strategy's packages are installed (:func:`check_packages`). No torch: the command line runs it on the config it composed
    from the cached schemas, so these are refused before anything heavy is imported. A group
    with a value still missing is left to its reader: ``data.path=???`` is stood in for by
    the planner, and refused by name by pre-flight's task check (``to_object`` would only say
    "missing mandatory value"). ``world_size``: the job's, where it is known (a spawning job's
    ``trainer.world_size``, torchrun's or SLURM's), for the values that must divide it; None
    (a plan of other world sizes): not held here."""
    for key in cfg:
        if OmegaConf.is_missing(cfg, key):
            continue
        node = cfg[key]
        if not OmegaConf.is_config(node):
            continue
        if not OmegaConf.missing_keys(node):
            typed(node)
        if key == "model":  # a value still missing is skipped, the others held
            check_model_sizes(node)
        if isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node)):
            check_bounds(str(key), node, OmegaConf.get_type(node), world_size)
    if all(k in cfg and not OmegaConf.is_missing(cfg, k) for k in ("data", "model")):
        check_fed(cfg.data, cfg.model)
    if "strategy" in cfg and not OmegaConf.is_missing(cfg, "strategy"):
        check_packages(cfg.strategy)


def check_packages(strategy: Any, requires: tuple[str, ...] | None = None) -> None:
    """A strategy whose schema declares packages it needs beyond torch (class attribute
    ``REQUIRES``, carried by the schema cache) is refused where one cannot be imported here,
    naming it: found without importing anything (:func:`sharded_exp.errors.missing_packages`).
    ``requires``: the packages to hold instead (pre-flight's: the strategy's ``traits.requires``,
    which a plugin may state without the class attribute)."""
    if requires is None:
        schema = OmegaConf.get_type(strategy) if OmegaConf.is_config(strategy) else type(strategy)
        requires = getattr(schema, "REQUIRES", None) or ()
    missing = missing_packages(requires)
    _require(
        not missing,
        f"strategy={_get(strategy, 'name')} needs the package(s) {', '.join(missing)}, which are not installed here "
        "(pip install -e . installs them)",
    )


def require_model_fields(task: str, feeds: str, model_cfg: Any, fields: tuple[str, ...]) -> None:
    """Refuse a model whose config lacks the fields data ``task`` sizes its samples by."""
    missing = [f for f in fields if f not in model_cfg]
    if missing:
        raise ConfigError(
            f"data={task} feeds {feeds}, not model={_get(model_cfg, 'name')}: it needs "
            + ", ".join(f"model.{f}" for f in fields)
            + f" (model={_get(model_cfg, 'name')} has no {', '.join(missing)})"
        )


def check_fed(data: Any, model: Any, schema: type | None = None) -> None:
    """A data task whose schema declares what it feeds (class attributes ``FEEDS``, the models
    in words, and ``MODEL_FIELDS``, the model's fields it sizes its samples by: data as
    :func:`bounded` is, carried by the schema cache) refuses a model without those fields. A
    task whose needs depend on its ``data.kind`` (hf_dataset) declares both per kind, as
    mappings. ``schema``: the task's class, where ``data`` may be untyped (a rank's plain
    config); else ``data``'s own type."""
    if schema is None:
        schema = OmegaConf.get_type(data) if OmegaConf.is_config(data) else type(data)
    fields, feeds = getattr(schema, "MODEL_FIELDS", None), getattr(schema, "FEEDS", None)
    if isinstance(fields, Mapping):  # per data.kind
        kind = _get(data, "kind")
        kind = str(getattr(kind, "value", kind))
        fields, feeds = fields.get(kind), (feeds or {}).get(kind)
    if fields:
        feeds = feeds or "the models that have these fields"
        require_model_fields(str(_get(data, "name")), feeds, model, tuple(fields))


def check_model_sizes(model: Any) -> None:
    """A model's sizes (widths, depths, heads, classes, sequence length, vocabulary) are
    counts: zero or negative ones build broken models or crash deep inside a rank. Every
    integer at the top of any model's config (the schemas live beside their builders; a
    Hugging Face model's own ``model.config`` is checked by pre-flight against its class).
    ``model``: its node, a dict or its dataclass; a value still missing (``???``) is skipped."""
    if dataclasses.is_dataclass(model):
        model = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    for key in list(model.keys()):
        value = _get(model, key)
        if isinstance(value, int) and not isinstance(value, bool):
            _require(value >= 1, f"model.{key}={value} must be >= 1 (model={_get(model, 'name')})")


BOUND_KINDS = ("at_least", "above", "at_most", "multiple_of", "divides_world_size")
"""What :func:`bounded` declares: ``value >= n``, ``value > n``, ``value <= n``,
``value % <the named field of the same group> == 0``, and ``world_size % value == 0`` (its
value: why, in words), held where the job's world size is known (:func:`check_ranges`'s
``world_size``)."""


def bounded(default: Any, **bounds: Any) -> Any:
    """A schema field whose bounds are data (its metadata), so that the schema cache
    (:mod:`sharded_exp.schema_cache`) carries them to the command line and
    :func:`check_bounds` holds them there and in pre-flight alike: a registry schema (a
    strategy's, a model's, a data task's) lives beside a builder that imports torch, where
    ``__post_init__`` checks would run only once torch is imported.
    ``bounded(25.0, at_least=0)``, ``bounded(128, multiple_of="n_heads")``."""
    unknown = set(bounds) - set(BOUND_KINDS)
    if unknown:
        raise TypeError(f"bounds {sorted(unknown)} are not among {BOUND_KINDS}")
    return field(default=default, metadata={"bounds": bounds})


def check_bounds(group: str, values: Any, schema: type, world_size: int | None = None) -> None:
    """Refuse a value of ``group`` outside the bounds ``schema``'s fields declare
    (:func:`bounded`), naming it and what is allowed; ``values``: the group's node or its
    dataclass. The limits first, then the divisions (a zero divides nothing), then what must
    divide ``world_size`` (the job's; None: not known here, not held)."""
    declared = [(f.name, f.metadata.get("bounds", {})) for f in dataclasses.fields(schema) if f.metadata.get("bounds")]
    option = f" ({group}={_get(values, 'name')})" if _get(values, "name") is not None else ""
    for name, bounds in declared:
        value = _get(values, name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # null (a default decided later) or an interpolation Hydra has not typed
        for kind, limit, ok, said in (
            ("at_least", bounds.get("at_least"), lambda v, n: v >= n, ">="),
            ("above", bounds.get("above"), lambda v, n: v > n, ">"),
            ("at_most", bounds.get("at_most"), lambda v, n: v <= n, "<="),
        ):
            if limit is not None:
                _require(ok(value, limit), f"{group}.{name}={value} must be {said} {limit}{option}")
    for name, bounds in declared:
        other = bounds.get("multiple_of")
        value, divisor = _get(values, name), _get(values, other) if other else None
        if isinstance(value, int) and isinstance(divisor, int) and divisor > 0:
            _require(value % divisor == 0, f"{group}.{name}={value} is not divisible by {group}.{other}={divisor}")
    for name, bounds in declared:
        why, value = bounds.get("divides_world_size"), _get(values, name)
        if not why or not isinstance(world_size, int) or world_size < 1 or not isinstance(value, int) or value < 1:
            continue  # nothing to divide, or a world size not known here (a value below 1: its own bound says)
        if world_size % value:
            divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(
                f"{group}.{name}={value} must divide trainer.world_size={world_size} ({why}; divisors: {divisors})"
            )


def _get(values: Any, name: str) -> Any:
    """``values[name]``: a node's (None while it is missing), a dict's or a dataclass's."""
    if isinstance(values, DictConfig):
        return None if name not in values or OmegaConf.is_missing(values, name) else values.get(name)
    return values.get(name) if isinstance(values, dict) else getattr(values, name, None)
