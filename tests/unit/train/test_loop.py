"""sharded_exp.train.loop: which steps warm up, are tracked, profiled and timed (Windows.plan),
LoopSettings.from_config, and run_loop driven in-process (world-size-1 gloo, a tiny model
under the base Strategy, recording components)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.config import TrainerConfig
from sharded_exp.measure.tracker import MemoryMeter
from sharded_exp.train import components as parts
from sharded_exp.train.loop import LoopSettings, Windows, run_loop
from tests.helpers.unit_train import ListLogger, PlainStrategy, Recorder, TinyClassifier, tiny_task

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # plan reads the device's type only


def settings(steps, warmup, *, profile=0, compiled=False, log_interval=2, min_timed=0, grad_accum=1):
    return LoopSettings(steps=steps, warmup_steps=warmup, batch_size=8, grad_accum=grad_accum, grad_clip=0.0,
                        log_interval=log_interval, compiled=compiled, profile_steps=profile,
                        min_timed_steps=min_timed)  # fmt: skip


# ----------------------------------------------------------------------------- Windows.plan
def test_on_cuda_the_warmup_steps_are_untimed_and_memory_spans_the_whole_run():
    w = Windows.plan(settings(10, 3), 0, CUDA, profiling=False)
    assert (w.timed_from, w.memory_end, w.compile_step) == (3, 10, 0)
    assert (w.profile_from, w.profile_count, w.profile_note) == (3, 0, None)


def test_on_cpu_the_tracker_covers_at_least_two_steps_and_they_are_not_timed():
    w = Windows.plan(settings(10, 1), 0, CPU, profiling=False)
    assert w.memory_end == 2  # warm-up 1, but the tracker needs the second (steady) step too
    assert w.timed_from == 2  # the tracked steps are not timed


def test_on_cpu_a_longer_warmup_is_the_tracker_window():
    w = Windows.plan(settings(10, 5), 0, CPU, profiling=False)
    assert (w.memory_end, w.timed_from) == (5, 5)


def test_a_resumed_loop_warms_up_again_from_its_start_step():
    w = Windows.plan(settings(10, 1), 4, CPU, profiling=False)
    assert (w.timed_from, w.memory_end, w.compile_step) == (6, 6, 4)
    w = Windows.plan(settings(10, 3), 4, CUDA, profiling=False)
    assert (w.timed_from, w.compile_step) == (7, 4)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_run_too_short_for_its_warmup_still_times_its_last_step(device):
    w = Windows.plan(settings(3, 5), 0, device, profiling=False)
    assert w.timed_from == 2  # steps - 1: one timed step at least


def test_on_cpu_a_two_step_run_times_a_tracked_step():
    w = Windows.plan(settings(2, 5), 0, CPU, profiling=False)
    assert (w.memory_end, w.timed_from) == (2, 1)  # step 1 is tracked and timed: nothing else to time


def test_a_one_step_run_times_that_step():
    w = Windows.plan(settings(1, 5), 0, CPU, profiling=False)
    assert (w.memory_end, w.timed_from) == (1, 0)


def test_compiled_on_cpu_compiles_after_the_tracked_steps_in_one_more_untimed_step():
    w = Windows.plan(settings(10, 1, compiled=True), 0, CPU, profiling=False)
    assert w.memory_end == 2
    assert w.compile_step == 2  # the first step tracked by nothing
    assert w.timed_from == 3  # the compiling step is not timed


def test_compiled_on_cuda_compiles_at_the_first_step():
    w = Windows.plan(settings(10, 2, compiled=True), 3, CUDA, profiling=False)
    assert (w.compile_step, w.timed_from) == (3, 5)


def test_profiled_steps_come_right_after_warmup_and_are_not_timed():
    w = Windows.plan(settings(10, 1, profile=3), 0, CPU, profiling=True)
    assert (w.profile_from, w.profile_count) == (2, 3)  # after the two tracked steps
    assert w.timed_from == 5
    assert w.profile_note is None


def test_no_step_is_profiled_unless_profiling():
    w = Windows.plan(settings(10, 1, profile=3), 0, CPU, profiling=False)
    assert (w.profile_count, w.timed_from) == (0, 2)


def test_profiled_steps_are_cut_so_that_one_step_is_timed_and_the_cut_is_noted():
    w = Windows.plan(settings(5, 1, profile=5), 0, CPU, profiling=True)
    # 5 steps: 2 tracked, 1 timed, so 2 profiled
    assert (w.profile_from, w.profile_count, w.timed_from) == (2, 2, 4)
    assert w.profile_note.startswith("2 of trainer.profile_steps=5 profiled")
    assert "CPU memory tracker" in w.profile_note and "took 2 of the 5 steps" in w.profile_note
    cuda = Windows.plan(settings(5, 1, profile=5), 0, CUDA, profiling=True)
    assert (cuda.profile_count, cuda.timed_from) == (3, 4)
    assert "CPU memory tracker" not in cuda.profile_note


def test_every_window_leaves_at_least_one_timed_step_and_keeps_its_order():
    grid = itertools.product([CPU, CUDA], [False, True], [0, 3], [4, 5, 9], [0, 1, 2, 6], [0, 1, 4])
    for device, compiled, start, steps, warmup, profile in grid:
        case = f"{device.type} compiled={compiled} start={start} steps={steps} warmup={warmup} profile={profile}"
        w = Windows.plan(settings(steps, warmup, profile=profile, compiled=compiled), start, device, profiling=True)
        assert start <= w.timed_from <= steps - 1, case
        assert w.profile_from + w.profile_count == w.timed_from, case  # profiled steps end where timing starts
        assert w.profile_count <= profile, case
        if device.type == "cpu":
            assert w.memory_end - start == min(max(min(warmup, steps - start - 1), 2), steps - start), case
            if w.memory_end < steps:  # a run long enough: nothing tracked is timed
                assert w.timed_from >= w.memory_end, case
        else:
            assert w.memory_end == steps, case
        assert w.timed_from - w.profile_count - start >= min(warmup, steps - start - 1), case


# --------------------------------------------------------------------------- LoopSettings
def test_loop_settings_read_the_trainer_config():
    t = OmegaConf.structured(TrainerConfig(steps=7, warmup_steps=2, batch_size=4, grad_accum=3, grad_clip=0.5,
                                           log_interval=5, progress_bar=False, compile=True, profile=True,
                                           profile_steps=2, min_timed_steps=11))  # fmt: skip
    loop = LoopSettings.from_config(t, label="ddp x2")
    assert (loop.steps, loop.warmup_steps, loop.batch_size, loop.grad_accum) == (7, 2, 4, 3)
    assert (loop.grad_clip, loop.log_interval, loop.progress_bar, loop.label) == (0.5, 5, False, "ddp x2")
    assert (loop.compiled, loop.profile_steps, loop.min_timed_steps) == (True, 2, 11)


def test_loop_settings_profile_no_step_unless_trainer_profile_is_on():
    t = OmegaConf.structured(TrainerConfig(profile=False, profile_steps=4))
    assert LoopSettings.from_config(t).profile_steps == 0


def test_loop_settings_default_min_timed_steps_to_zero_when_the_config_lacks_it():
    t = OmegaConf.create({"steps": 3, "warmup_steps": 1, "batch_size": 2, "grad_accum": 1, "grad_clip": 0.0,
                          "log_interval": 1, "progress_bar": False, "compile": False, "profile": False,
                          "profile_steps": 0})  # fmt: skip
    assert LoopSettings.from_config(t).min_timed_steps == 0


# ------------------------------------------------------------------------------- run_loop
class StopAt:
    """A stopper whose agreed stop comes at ``step`` (None: never)."""

    def __init__(self, step=None):
        self.step, self.asked, self.finished = step, [], 0

    def should_stop(self, step):
        self.asked.append(step)
        return self.step is not None and step >= self.step

    def finish(self):
        self.finished += 1


def loop_run(loop, *, start=0, stopper=None, components=(), logger=None, strategy=None):
    strategy = strategy or PlainStrategy(TinyClassifier())
    kwargs = {"logger": logger} if logger is not None else {}
    return run_loop(strategy, tiny_task(), torch.autocast("cpu", enabled=False), loop, start=start,
                    meter=MemoryMeter(CPU), stopper=stopper or StopAt(), components=list(components),
                    **kwargs)  # fmt: skip


def test_run_loop_calls_each_components_hooks_in_order_for_every_step(gloo_group):
    rec = Recorder()
    out = loop_run(settings(3, 1), components=[rec])
    expected = []
    for step in range(3):
        expected += [("before_step", step), ("after_step", step), ("between_steps", step + 1)]
    assert rec.calls == expected + [("end", (3, False)), ("close", 3)]
    assert (out.steps_done, out.stopped) == (3, False)


def test_run_loop_resumed_runs_the_steps_from_start(gloo_group):
    rec, stopper = Recorder(), StopAt()
    out = loop_run(settings(5, 1), start=3, components=[rec], stopper=stopper)
    assert [v for k, v in rec.calls if k == "before_step"] == [3, 4]
    assert stopper.asked == [3, 4] and stopper.finished == 1
    assert out.steps_done == 5


def test_run_loop_stops_where_the_ranks_agreed_and_says_so(gloo_group):
    rec, stopper = Recorder(), StopAt(2)
    out = loop_run(settings(6, 1), components=[rec], stopper=stopper)
    assert [v for k, v in rec.calls if k == "before_step"] == [0, 1]  # step 2 never started
    assert (out.steps_done, out.stopped) == (2, True)
    assert ("end", (2, True)) in rec.calls
    assert stopper.finished == 1


def test_run_loop_times_only_the_steps_after_the_warmup_window(gloo_group):
    out = loop_run(settings(6, 1))
    # CPU: steps 0 and 1 are the tracker's window, steps 2..5 are timed
    assert out.throughput["timed_steps"] == 4
    assert len(out.throughput["step_times_s"]) == 4


def test_run_loop_logs_one_record_per_interval_and_the_last_step(gloo_group):
    logger = ListLogger()
    out = loop_run(settings(5, 1, log_interval=2), logger=logger)
    assert [r["step"] for r in out.history] == [2, 4, 5]
    interval_steps = [s for s, v in logger.logged if "loss" in v]
    assert interval_steps == [2, 4, 5]
    assert [s for s, _ in logger.logged] == sorted(s for s, _ in logger.logged)  # in step order


def test_run_loop_returns_the_last_steps_loss(gloo_group):
    seen = []

    class Losses(parts.Component):
        def after_step(self, result):
            seen.append(result.loss.item())

    out = loop_run(settings(3, 1), components=[Losses()])
    assert out.loss.item() == seen[-1]


def test_run_loop_warns_when_fewer_steps_are_timed_than_min_timed_steps(gloo_group, caplog):
    with caplog.at_level(logging.WARNING, logger="sharded_exp.train.loop"):
        loop_run(settings(4, 1, min_timed=3))  # timed: steps 2, 3
    assert any("2 timed step(s) (steps 2 to 3)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sharded_exp.train.loop"):
        loop_run(settings(4, 1, min_timed=2))
    assert not any("timed step(s)" in r.getMessage() for r in caplog.records)


class ScaleSequence:
    """A grad scaler (disabled, so steps run plainly) whose scale reads come from ``scales``."""

    def __init__(self, real, scales):
        self.real, self.scales = real, iter(scales)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def get_scale(self):
        return next(self.scales)


def test_run_loop_counts_the_steps_the_grad_scaler_skipped(gloo_group):
    strategy = PlainStrategy(TinyClassifier())
    # (before, after) each of steps 0..3: the scale drops in steps 1 and 3, as on an inf
    strategy.scaler = ScaleSequence(strategy.scaler, [4.0, 4.0, 4.0, 2.0, 2.0, 2.0, 2.0, 1.0])
    out = loop_run(settings(4, 1), strategy=strategy)
    assert out.skipped_steps == 2
