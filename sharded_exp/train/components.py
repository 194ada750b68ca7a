"""The parts of the training loop besides the step, each with the same hooks.

The loop (:func:`sharded_exp.train.loop.run_loop`) calls, for every part in order:

- ``before_step(step, strategy)``: once the step's data is read, before the step;
- ``after_step(result)``: right after the step, while its output and batch are alive;
- ``between_steps(out, position)``: once they are let go (checkpoints and evaluation run
  here, so a language model's logits are not alive through them); ``position()`` is where
  a user's dataset stands;
- ``end(out, position)``: once the loop stopped (the trace, the last interval, a stop's
  checkpoint); then the loop reads the memory window's figures;
- ``close(out)``: last (the final evaluation, outside the memory window).

Each part does nothing where it has nothing to do. The loop's own parts come first
(profiler, liveness, speed, skipped steps, memory window, metrics), the job's after them
(faults, checkpoints, evaluation: :func:`sharded_exp.train.trainer.train` makes those).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from sharded_exp.errors import is_oom
from sharded_exp.measure.host_malloc import minor_faults
from sharded_exp.measure.profile import StepProfiler
from sharded_exp.measure.tracker import MemoryMeter
from sharded_exp.train import liveness
from sharded_exp.train.faults import Injector
from sharded_exp.train.metrics import IntervalLog, IntervalMetrics, throughput_stats
from sharded_exp.train.records import LoopOutcome, LoopSettings, StepResult, Windows
from sharded_exp.vocabulary.wandb_names import DATA_TIME_S, SAMPLES_PER_S, STEP_TIME_S

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the loop imports this module
    from sharded_exp.checkpoint import CheckpointManager


class Component:
    """A part of the loop. Every hook does nothing unless a part needs it."""

    def before_step(self, step: int, strategy) -> None:
        pass

    def after_step(self, result: StepResult) -> None:
        pass

    def between_steps(self, out: LoopOutcome, position) -> None:
        pass

    def end(self, out: LoopOutcome, position: dict | None) -> None:
        pass

    def close(self, out: LoopOutcome) -> None:
        pass


def hooks(parts: list[Component], name: str) -> list:
    """The parts' ``name`` hooks, in order, leaving out those that do nothing (a call per
    part and step is a visible share of a small model's step: benchmarks/harness/overhead.py)."""
    return [getattr(p, name) for p in parts if getattr(type(p), name) is not getattr(Component, name)]


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on this platform
        return -1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ the loop's own parts
class Profiler(Component):
    """trainer.profile: a trace of the steps right after warm-up (they are not timed)."""

    def __init__(self, device: torch.device, path: str, windows: Windows):
        self.profiler = StepProfiler(device, path, windows.profile_from, windows.profile_count, windows.profile_note)

    def start(self, step: int) -> None:
        """At the very start of a step (before its data): the first profiled step starts the trace."""
        self.profiler.before_step(step)

    def label(self, step: int):
        """The step itself as a named range in the trace (``step 7``)."""
        return self.profiler.label(step)

    def after_step(self, result: StepResult) -> None:
        self.profiler.after_step(result.step, result.step_time)  # the last profiled step writes the trace

    def end(self, out: LoopOutcome, position) -> None:
        self.profiler.finish()  # stopped inside the profiled steps
        out.extra["profile"] = self.profiler.record()


class Liveness(Component):
    """Fails the step whose collective timed out (the loop names the step a hang is in)."""

    def __init__(self, device: torch.device):
        self.device = device

    def after_step(self, result: StepResult) -> None:
        liveness.raise_if_aborted(self.device)  # this step's collective timed out, not the next one's


class Speed(Component):
    """Step and data times of the timed steps, and the loop's wall time per step (data,
    checks, metrics, logging included: what the harness costs on top of the step, see
    benchmarks/harness/overhead.py)."""

    def __init__(self, device: torch.device, windows: Windows, loop: LoopSettings, world_size: int, log: IntervalLog):
        self.device, self.windows, self.log, self.compiled = device, windows, log, loop.compiled
        self.batches_per_step = loop.grad_accum * world_size
        self.samples_per_step = loop.batch_size * self.batches_per_step
        self.step_times: list[float] = []
        self.data_times: list[float] = []
        self.tokens_per_step = 0
        self.first_step_s: float | None = None
        self._start: float | None = None
        self._end: float | None = None
        self.loads: list[float] = []
        """The machine's 1-minute load average when the timed window opened and closed."""
        self._faults_before: int | None = None
        self.step_faults: list[int] = []
        """This process's minor page faults during each timed step (its batch's making and the
        evaluations, checkpoints and logging between steps left out)."""

    def start_window(self, step: int) -> None:
        if step == self.windows.timed_from:
            _sync(self.device)
            self._start = time.perf_counter()
            self.loads.append(_load())

    def stop_window(self) -> None:
        self._end = time.perf_counter()
        if self._start is not None:
            self.loads.append(_load())

    def before_step(self, step: int, strategy) -> None:
        self._faults_before = minor_faults() if step >= self.windows.timed_from else None

    def end(self, out: LoopOutcome, position: dict | None) -> None:
        """Every rank's page faults per timed step (result.json's ``memory.per_rank``)."""
        if self.step_faults:
            out.extra["page_faults_per_step"] = sum(self.step_faults) / len(self.step_faults)

    def after_step(self, result: StepResult) -> None:
        if self._faults_before is not None and result.step >= self.windows.timed_from:
            self.step_faults.append(minor_faults() - self._faults_before)  # first: the step's own
        if "input_ids" in result.batches[0]:
            self.tokens_per_step = result.batches[0]["input_ids"].numel() * self.batches_per_step
        if result.step == self.windows.compile_step:
            self.first_step_s = result.step_time
        if result.step >= self.windows.timed_from:
            self.step_times.append(result.step_time)
            self.data_times.append(result.data_time)
            self.log.add(
                result.step + 1,
                {
                    STEP_TIME_S: result.step_time,
                    SAMPLES_PER_S: self.samples_per_step / result.step_time,
                    DATA_TIME_S: result.data_time,
                },
            )

    def stats(self, steps_done: int, data_prefetched) -> dict[str, Any]:
        timed = steps_done - self.windows.timed_from
        loop_time = (self._end - self._start) / timed if self._start is not None and timed > 0 else None
        stats = throughput_stats(
            self.step_times, self.samples_per_step, self.tokens_per_step, loop_time, self.data_times
        )
        if stats:
            stats["data_prefetched"] = data_prefetched
            stats["first_step_s"] = self.first_step_s  # the first step (with compile: the compiling one)
            if self.compiled and self.first_step_s is not None:  # it is never timed
                stats["compile_s"] = max(0.0, self.first_step_s - stats["step_time_s_median"])
            # What else ran: a load above the cores means the steps waited for them.
            stats["load_avg_1m"] = max(self.loads) if self.loads and min(self.loads) >= 0 else None
            stats["cpu_count"] = os.cpu_count()
        return stats


class SkippedSteps(Component):
    """Steps the grad scaler skipped (it lowers its scale exactly when it found inf/nan)."""

    def __init__(self, strategy):
        self.scaler = strategy.scaler
        self.skipped = 0
        self._before = None

    def before_step(self, step: int, strategy) -> None:
        self._before = self.scaler.get_scale()

    def after_step(self, result: StepResult) -> None:
        self.skipped += int(self.scaler.get_scale() < self._before)

    def end(self, out: LoopOutcome, position) -> None:
        out.skipped_steps = self.skipped


class MemoryWindow(Component):
    """The memory meter's window: on CPU the tracked steps, on CUDA the whole run."""

    def __init__(self, meter: MemoryMeter, strategy, windows: Windows, compiled: bool):
        self.meter, self.windows, self.compiled = meter, windows, compiled
        self.memory: dict[str, Any] = {}

    def after_step(self, result: StepResult) -> None:
        self.meter.step_end(result.step)
        if result.step + 1 == self.windows.memory_end:
            self.memory = self.meter.stop()
            if self.compiled and self.meter.device.type == "cpu":
                from torch import _dynamo  # lazy: dynamo takes seconds to import; only a compiled CPU run needs it

                _dynamo.reset()

    def result(self) -> dict[str, Any]:
        """What the window measured (read after the parts' ``end``: a stop's checkpoint counts)."""
        return self.memory or self.meter.stop()


class Metrics(Component):
    """Loss and the task's metric per log interval, to the logger and the progress bar."""

    def __init__(self, strategy, task, meter: MemoryMeter, log: IntervalLog, loop: LoopSettings, start: int, rank: int):
        self.metrics = IntervalMetrics(meter.device, task, probe=lambda: meter.now(strategy))
        self.log = log
        self.loop = loop
        # A bar on a terminal; in a log (SLURM, CI, a file) a plain line per interval instead:
        # tqdm's carriage returns would fill it. A resumed run's bar starts where the
        # checkpoint left off and ends at 100%.
        shown = rank == 0 and loop.progress_bar
        self.lines = shown and not sys.stderr.isatty()
        self.bar = tqdm(total=loop.steps, initial=start, desc=loop.label, disable=not shown or self.lines)

    def after_step(self, result: StepResult) -> None:
        self.metrics.update(result.loss, result.output, result.batches[-1])

    def between_steps(self, out: LoopOutcome, position) -> None:
        # After the step's output is let go: the interval's memory reading (each rank's
        # allocated MiB) does not count the logits.
        self.bar.update(1)
        done = out.steps_done
        if done == self.loop.steps:  # its line is the end's, with the final loss
            self.log.publish(self.metrics.end_interval(done), self.bar)
        elif done % self.loop.log_interval == 0:
            record = self.metrics.end_interval(done)
            self.log.publish(record, self.bar)
            # the interval's record comes one interval late: it says its own step
            self._line(done, f", loss {record['loss']:.4f} at step {record['step']}" if record else "")

    def _line(self, done: int, loss: str) -> None:
        if self.lines:
            log.info(
                "%s: step %d/%d (%.0f%%)%s", self.loop.label, done, self.loop.steps, 100 * done / self.loop.steps, loss
            )

    def end(self, out: LoopOutcome, position) -> None:
        if self.metrics.updates:  # stopped in the middle of an interval
            self.log.publish(self.metrics.end_interval(out.steps_done), self.bar)
        self.log.publish(self.metrics.flush(), self.bar)
        # One last line, and the bar's last figure, say the final loss as result.json and the
        # end-of-run table do: the last step's, averaged over ranks (an interval's record is a
        # mean over its steps and arrives one interval late, so it matched neither).
        out.final_loss = _mean_over_ranks(out.loss)
        self.bar.set_postfix(loss=f"{out.final_loss:.4f}")
        self._line(out.steps_done, f", final loss {out.final_loss:.4f}")
        self.bar.close()
        out.extra["first_nonfinite_step"] = int(self.metrics.first_nonfinite)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """Collective: ``loss`` (this rank's) averaged over the ranks."""
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


# ---------------------------------------------------------------------- the job's parts
class Faults(Component):
    """The testing aid ``SHARDED_EXP_FAULT`` (:mod:`sharded_exp.train.faults`)."""

    def __init__(self, injector: Injector):
        self.injector = injector

    def before_step(self, step: int, strategy) -> None:
        self.injector.before_step(step, strategy)

    def after_step(self, result: StepResult) -> None:
        self.injector.after_step()


class TrackerStart(Component):
    """The tracker's start, which runs beside the warm-up steps (W&B's takes seconds), waited
    for after them, by every rank together: the timed and the profiled steps then do not share
    the machine with it, and the wait falls between two steps, outside every timed window.
    ``at``: the steps done when the warm-up ends (:attr:`Windows.profile_from`)."""

    def __init__(self, logger, at: int):
        self.logger, self.at = logger, at

    def between_steps(self, out: LoopOutcome, position) -> None:
        if out.steps_done == self.at:
            self.logger.wait_started()  # rank 0's; a no-op on the others
            dist.barrier()  # the others wait here, not in the first timed step's collective


class Checkpoints(Component):
    """The checkpoints that are due, the one at a stop, and an asynchronous save finished."""

    def __init__(self, manager: CheckpointManager, strategy, meter: MemoryMeter, steps: int):
        self.manager, self.strategy, self.meter, self.steps = manager, strategy, meter, steps

    def between_steps(self, out: LoopOutcome, position) -> None:
        if not self.manager.due(out.steps_done, self.steps):
            return
        with self.meter.guard(self.strategy):  # untimed: the memory budget still holds
            out.checkpoint = self.manager.after_step(
                self.strategy, out.steps_done, self.steps, self.meter.device, position
            )

    def end(self, out: LoopOutcome, position) -> None:
        if not self.manager.every:
            return
        if out.stopped and self.manager.saved_step != out.steps_done:
            with self.meter.guard(self.strategy):
                out.checkpoint = self.manager.on_stop(self.strategy, out.steps_done, self.meter.device, position)
        self.manager.finish()  # an asynchronous save still in flight is completed and published
        out.extra["checkpoint_rss_growth_mib"] = self.manager.rss_growth_mib


class Evaluation(Component):
    """``evaluate(step) -> {"eval/...": value}`` every ``every`` steps (outside the memory
    window) and once at the end."""

    def __init__(self, evaluate, every: int, meter: MemoryMeter, log: IntervalLog, steps: int):
        self.evaluate, self.every, self.meter, self.log, self.steps = evaluate, every, meter, log, steps

    def between_steps(self, out: LoopOutcome, position) -> None:
        done = out.steps_done
        if self.every and done % self.every == 0 and not self.meter.tracking and done < self.steps:
            with self.meter.paused():  # the last step's pass is the final one, at close
                out.evals.append(self._evaluated(done))

    def final(self, out: LoopOutcome) -> None:
        """The pass at the end of training, run by the trainer once the training's figures are
        gathered and kept (:data:`sharded_exp.train.trainer.TRAINED`): an out-of-memory here
        loses none of them, and says it happened in this pass."""
        if out.stopped:
            return
        try:
            out.evals.append(self._evaluated(out.steps_done))
        except Exception as exc:
            if not is_oom(exc):
                raise
            kind = torch.OutOfMemoryError if isinstance(exc, torch.OutOfMemoryError) else RuntimeError
            raise kind(f"out of memory in the final evaluation, after training finished: {exc}") from exc

    def _evaluated(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        record = {"step": step, **self.evaluate(step), "seconds": time.perf_counter() - t0}
        self.log.add(step, {k: v for k, v in record.items() if k.startswith("eval/")})
        return record
