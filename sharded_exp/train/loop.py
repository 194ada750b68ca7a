"""The training loop that runs on every rank, read top to bottom.

:func:`run_loop` trains steps ``start`` to ``trainer.steps``. Everything it does besides the
step itself is a component (:mod:`sharded_exp.train.components`) with hooks the loop calls
in order: ``before_step``, ``after_step`` (while the step's output and batch are alive),
``between_steps`` (once they are let go: checkpoints, evaluation) and ``end``. Which steps
warm up, are tracked for memory, profiled and timed is decided once, before the first
step (:class:`Windows`). The step itself is :func:`~sharded_exp.train.step.train_step`; the
loop never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sharded_exp.config import TrainerConfig
from sharded_exp.data import Task
from sharded_exp.data.loader import step_loader
from sharded_exp.measure.tracker import MemoryMeter
from sharded_exp.output.loggers import NullLogger
from sharded_exp.strategies.base import Strategy
from sharded_exp.train import components as parts
from sharded_exp.train import liveness
from sharded_exp.train.metrics import IntervalLog
from sharded_exp.train.step import train_step

_log = logging.getLogger(__name__)  # ("log" is run_loop's interval log)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def run_loop(
    strategy: Strategy,
    task: Task,
    autocast,
    loop: LoopSettings,
    *,
    start: int = 0,
    meter: MemoryMeter,
    stopper: liveness.StopAgreement,
    logger=NullLogger(),
    log: IntervalLog | None = None,
    components: list[parts.Component] = (),
    profile_path: str | None = None,
    data_position: dict | None = None,
) -> LoopOutcome:
    """Train steps ``start`` to ``loop.steps`` on this rank (a collective: every rank calls it).

    Memory is measured by ``meter`` (on CPU over the warm-up steps only), a stop requested
    by a signal is agreed through ``stopper``, metrics go to ``logger`` one interval late
    (through ``log``, when the job's parts log too).
    ``components``: the job's own parts (faults, checkpoints, evaluation), called after the
    loop's. ``profile_path``: where this rank's trace of ``loop.profile_steps`` steps after
    warm-up goes. ``data_position``: where a resumed run starts in a user's dataset (the
    checkpoint's; None: at ``start``).
    """
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), meter.device
    windows = Windows.plan(loop, start, device, profiling=profile_path is not None)
    if rank == 0:
        _warn_if_few_timed(loop, windows)
    # A DataLoader over a user's dataset, or the synthetic tasks' prefetcher; timed here.
    # No batch made in another thread beside a step the CPU tracker measures: it would not see it.
    quiet_until = windows.memory_end if device.type == "cpu" else start
    data = step_loader(task, rank, world_size, loop, device, start, data_position, quiet_until)
    metrics = parts.Metrics(strategy, task, meter, log or IntervalLog(logger), loop, start, rank)
    speed = parts.Speed(device, windows, loop, world_size, metrics.log)
    memory = parts.MemoryWindow(meter, strategy, windows, loop.compiled)
    profiler = (
        parts.Profiler(device, profile_path, windows) if profile_path is not None and loop.profile_steps else None
    )
    every = [
        *([profiler] if profiler is not None else []),
        parts.Liveness(device),
        speed,
        parts.SkippedSteps(strategy),
        memory,
        metrics,
        *components,
    ]
    before, after, between = (parts.hooks(every, name) for name in ("before_step", "after_step", "between_steps"))
    out = LoopOutcome(start, torch.zeros(()), metrics.log.history, {}, {}, 0, time.time())
    for step in range(start, loop.steps):
        speed.start_window(step)
        if stopper.should_stop(step):  # a signal reached some rank: all stop here, together
            break
        liveness.current_step = step  # a hang is named by its step
        loss = _take_step(step, strategy, autocast, loop, data, device, profiler, hooks=(before, after))
        out.steps_done, out.loss = step + 1, loss
        for hook in between:
            hook(out, data.position)
    sync(device)
    speed.stop_window()
    position = data.position()  # before close: a stop's checkpoint records it
    data.close()
    out.last_step_unix = time.time()
    stopper.finish()
    out.stopped = out.steps_done < loop.steps
    for part in every:
        part.end(out, position)  # the trace, the last interval, a stop's checkpoint
    out.memory = memory.result()
    for part in every:
        part.close(out)  # the final evaluation, outside the memory window
    metrics.log.flush()
    out.throughput = speed.stats(out.steps_done, data.ahead)
    return out


def _warn_if_few_timed(loop: LoopSettings, windows: Windows) -> None:
    """Fewer timed steps than trainer.min_timed_steps: the median step is said to be unsteady."""
    timed = loop.steps - windows.timed_from
    if timed < loop.min_timed_steps:
        _log.warning("%d timed step(s) (steps %d to %d): fewer than trainer.min_timed_steps=%d, so the median "
                     "step's interval is wide; more trainer.steps time more", timed, windows.timed_from,
                     loop.steps - 1, loop.min_timed_steps)  # fmt: skip


def _take_step(
    step: int, strategy: Strategy, autocast, loop: LoopSettings, data, device, profiler, hooks
) -> torch.Tensor:
    """One step, with the hooks around it (``hooks``: the components' ``before_step`` and
    ``after_step``): its batches fetched (timed apart), the optimizer step timed between two
    synchronisations, and profiled when the profiler's window is on. Returns the step's loss.

    The step's output and batches are let go when this returns: otherwise the logits (batch x
    time x vocab for a language model) stay alive through a checkpoint and the next step's peak.
    """
    before, after = hooks
    if profiler is not None:
        profiler.start(step)
    t_data = time.perf_counter()
    batches = data.get(step)
    data_time = time.perf_counter() - t_data
    for hook in before:
        hook(step, strategy)
    sync(device)
    t0 = time.perf_counter()
    with profiler.label(step) if profiler is not None else contextlib.nullcontext():
        loss, output = train_step(strategy, batches, autocast, loop.grad_clip)
    sync(device)
    result = StepResult(step, loss, output, batches, time.perf_counter() - t0, data_time)
    del output, batches  # the result holds the only references
    for hook in after:
        hook(result)
    return loss
