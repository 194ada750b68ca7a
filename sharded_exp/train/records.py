"""What the training loop decides and hands around: its settings, its windows (which steps
warm up, are tracked, profiled and timed), one step's result for the components, and the
loop's outcome. Apart from :mod:`sharded_exp.train.loop` so that the components, which the
loop calls, can name them without importing the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sharded_exp.config import TrainerConfig


@dataclass
class LoopSettings:
    """The trainer config's values the loop reads, as plain attributes (an OmegaConf
    lookup costs tens of microseconds, several per step)."""

    steps: int
    warmup_steps: int
    batch_size: int
    grad_accum: int
    grad_clip: float
    log_interval: int
    progress_bar: bool = False
    label: str = ""
    compiled: bool = False
    profile_steps: int = 0
    """Steps profiled right after warm-up (trainer.profile); 0: none."""
    min_timed_steps: int = 0
    """Timed steps a stable median needs (trainer.min_timed_steps); fewer are warned of."""

    @classmethod
    def from_config(cls, trainer_cfg: TrainerConfig, label: str = "") -> "LoopSettings":
        t = trainer_cfg
        return cls(
            t.steps, t.warmup_steps, t.batch_size, t.grad_accum, t.grad_clip, t.log_interval, t.progress_bar, label,
            bool(t.compile), t.profile_steps if t.profile else 0, t.get("min_timed_steps", 0),
        )  # fmt: skip


@dataclass
class LoopOutcome:
    """What one run of the loop did, on every rank."""

    steps_done: int
    loss: torch.Tensor
    """The last step's loss on this rank (not yet reduced)."""
    history: list[dict[str, float]]
    throughput: dict[str, float]
    memory: dict[str, Any]
    skipped_steps: int
    first_step_unix: float
    last_step_unix: float = 0.0
    checkpoint: str | None = None
    stopped: bool = False
    evals: list[dict[str, float]] = field(default_factory=list)
    """Evaluation records (``step`` and ``eval/*`` values)."""
    extra: dict[str, Any] = field(default_factory=dict)
    final_loss: float | None = None
    """The last step's loss averaged over ranks (result.json's ``final_loss``), reduced once at
    the loop's end by the Metrics part, which prints it as the progress's last figure."""


@dataclass
class StepResult:
    """One step as the components see it."""

    step: int
    """The step's index; ``step + 1`` steps are done after it."""
    loss: torch.Tensor
    output: Any
    batches: list
    step_time: float
    data_time: float


@dataclass(frozen=True)
class Windows:
    """Which steps of a (re)started loop do what, decided before the first.

    A (re)started process warms up again: the first steps after ``start`` are not timed,
    but at least one step is. The CPU memory tracker slows every op: it runs over the
    warm-up steps, and over two at least, as the first step's forward and backward run
    before the optimizer's state exists and the second is the steady one. Tracked steps
    are not timed, unless a run is too short to time any other. Profiled steps come right
    after (and are not timed either).
    """

    timed_from: int
    """The first timed step."""
    memory_end: int
    """Memory is measured until this step (exclusive): the CPU tracker's window; on CUDA the whole run."""
    compile_step: int
    """Where trainer.compile's units compile (the first step tracked by nothing)."""
    profile_from: int
    profile_count: int
    profile_note: str | None = None

    @classmethod
    def plan(cls, loop: LoopSettings, start: int, device: torch.device, profiling: bool) -> "Windows":
        left = loop.steps - start
        warmup = min(loop.warmup_steps, left - 1)
        memory_end, compile_step = loop.steps, start
        if device.type == "cpu":
            memory_end = start + min(max(warmup, 2), left)
            warmup = min(memory_end - start, left - 1)
            if loop.compiled:
                # Dynamo skips, for good, a function first called under a dispatch mode (the CPU
                # tracker's): the tracked steps run eager, its caches are reset after them, and
                # the units compile in one more untimed step.
                compile_step = memory_end
                warmup = min(memory_end - start + 1, left - 1)
        count, note = 0, None
        if loop.profile_steps and profiling:
            # Right after warm-up (and the CPU tracker's window), before the timed steps: one
            # timed step at least remains.
            count = max(0, min(loop.profile_steps, left - warmup - 1))
            if count < loop.profile_steps:
                note = (f"{count} of trainer.profile_steps={loop.profile_steps} profiled: the warm-up"
                        f"{' and the CPU memory tracker' if device.type == 'cpu' else ''} took {warmup} of the "
                        f"{left} steps and one is timed")  # fmt: skip
        return cls(start + warmup + count, memory_end, compile_step, start + warmup, count, note)
