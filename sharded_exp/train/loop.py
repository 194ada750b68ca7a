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

import torch
import torch.distributed as dist

from sharded_exp.data import Task
from sharded_exp.data.loader import step_loader
from sharded_exp.measure.tracker import MemoryMeter
from sharded_exp.output.loggers import NullLogger
from sharded_exp.strategies.base import Strategy
from sharded_exp.train import components as parts
from sharded_exp.train import liveness
from sharded_exp.train.metrics import IntervalLog
from sharded_exp.train.records import LoopOutcome, LoopSettings, StepResult, Windows
from sharded_exp.train.step import train_step

_log = logging.getLogger(__name__)  # ("log" is run_loop's interval log)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    liveness.steps_done = start  # a resumed run's steps before this one are done
    for step in range(start, loop.steps):
        speed.start_window(step)
        if stopper.should_stop(step):  # a signal reached some rank: all stop here, together
            break
        liveness.current_step = step  # a hang is named by its step
        loss = _take_step(step, strategy, autocast, loop, data, device, profiler, hooks=(before, after))
        out.steps_done, out.loss = step + 1, loss
        liveness.steps_done = step + 1  # how far it got, should a later part of this step fail
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
