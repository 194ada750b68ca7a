"""sharded_exp.train.components: each part of the loop (Profiler, Liveness, Speed,
SkippedSteps, MemoryWindow, Metrics, Faults, Checkpoints, Evaluation) through its hooks,
with stand-in collaborators; and ``hooks``, which leaves out the hooks a part does not have."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch

from sharded_exp.train import components as parts
from sharded_exp.train.metrics import IntervalLog
from sharded_exp.train.records import LoopOutcome, LoopSettings, StepResult, Windows
from tests.helpers.unit_train import ListLogger, PlainStrategy, TinyClassifier, batch, tiny_task

CPU = torch.device("cpu")


def windows(timed_from=2, memory_end=2, compile_step=0, profile_from=2, profile_count=0, note=None):
    return Windows(timed_from, memory_end, compile_step, profile_from, profile_count, note)


def loop_settings(steps=6, log_interval=2, batch_size=8, grad_accum=1, compiled=False, progress_bar=False):
    return LoopSettings(steps=steps, warmup_steps=1, batch_size=batch_size, grad_accum=grad_accum, grad_clip=0.0,
                        log_interval=log_interval, progress_bar=progress_bar, label="ddp x2",
                        compiled=compiled)  # fmt: skip


def result(step, step_time=0.5, data_time=0.01, batches=None, loss=1.0, output=None):
    return StepResult(step, torch.tensor(loss), output, batches or [{"x": torch.zeros(1)}], step_time, data_time)


def outcome(steps_done=0):
    return LoopOutcome(steps_done, torch.zeros(()), [], {}, {}, 0, 0.0)


# ----------------------------------------------------------------------------------- hooks
def test_hooks_leave_out_the_parts_that_do_not_override_a_hook():
    class After(parts.Component):
        def after_step(self, result):
            pass

    a, b = After(), parts.Component()
    assert parts.hooks([a, b], "after_step") == [a.after_step]
    assert parts.hooks([a, b], "before_step") == []


def test_hooks_keep_the_parts_order():
    class One(parts.Component):
        def between_steps(self, out, position):
            pass

    first, second = One(), One()
    assert parts.hooks([first, parts.Component(), second], "between_steps") == [
        first.between_steps,
        second.between_steps,
    ]


# -------------------------------------------------------------------------------- Profiler
def test_profiler_profiles_the_windows_steps_and_records_its_trace_at_the_end(monkeypatch):
    made = {}

    class FakeStepProfiler:
        def __init__(self, device, path, first, count, note):
            made.update(device=device, path=path, first=first, count=count, note=note)
            self.calls = []

        def before_step(self, step):
            self.calls.append(("before", step))

        def after_step(self, step, step_time):
            self.calls.append(("after", step, step_time))

        def finish(self):
            self.calls.append(("finish",))

        def record(self):
            return {"steps": "recorded"}

    monkeypatch.setattr(parts, "StepProfiler", FakeStepProfiler)
    p = parts.Profiler(CPU, "trace.json", windows(profile_from=3, profile_count=2, note="cut"))
    assert made == {"device": CPU, "path": "trace.json", "first": 3, "count": 2, "note": "cut"}
    p.start(3)
    p.after_step(result(3, step_time=0.25))
    out = outcome(4)
    p.end(out, None)
    assert p.profiler.calls == [("before", 3), ("after", 3, 0.25), ("finish",)]
    assert out.extra["profile"] == {"steps": "recorded"}


# -------------------------------------------------------------------------------- Liveness
def test_liveness_on_cpu_lets_every_step_pass():
    parts.Liveness(CPU).after_step(result(0))  # gloo raises in the step itself: nothing to check


# ----------------------------------------------------------------------------------- Speed
class FakeClock:
    def __init__(self, times):
        self.times = iter(times)

    def perf_counter(self):
        return next(self.times)


def speed(monkeypatch, loads=(1.5,), w=None, grad_accum=1, world_size=2, compiled=False, clock=(0.0,)):
    monkeypatch.setattr(parts, "time", FakeClock(clock))
    load_values = iter(loads)
    monkeypatch.setattr(parts, "_load", lambda: next(load_values))
    log = IntervalLog(ListLogger())
    return parts.Speed(CPU, w or windows(), loop_settings(grad_accum=grad_accum, compiled=compiled), world_size,
                       log), log  # fmt: skip


def test_speed_times_only_the_steps_from_timed_from(monkeypatch):
    s, log = speed(monkeypatch, w=windows(timed_from=2))
    for step, t in enumerate([9.0, 8.0, 0.5, 0.25]):
        s.after_step(result(step, step_time=t, data_time=t / 10))
    assert s.step_times == [0.5, 0.25]
    assert s.data_times == [0.05, 0.025]
    # samples per step: batch 8 x grad_accum 1 x world size 2
    assert [(step, v["throughput/samples_per_s"]) for step, v in log._pending] == [(3, 16 / 0.5), (4, 16 / 0.25)]


def test_speed_counts_samples_over_every_micro_batch_and_rank(monkeypatch):
    s, log = speed(monkeypatch, grad_accum=3, world_size=4)
    assert s.samples_per_step == 8 * 3 * 4
    ids = {"input_ids": torch.zeros(8, 16, dtype=torch.long)}
    s.after_step(result(0, batches=[ids]))
    assert s.tokens_per_step == 8 * 16 * 3 * 4


def test_speed_keeps_the_compile_steps_time_as_the_first_step(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=4, compile_step=2))
    for step in range(4):
        s.after_step(result(step, step_time=10.0 + step))
    assert s.first_step_s == 12.0


def test_speed_opens_its_window_at_timed_from_only_and_divides_the_loop_time_by_the_timed_steps(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=2), clock=(100.0, 112.0), loads=(0.5, 2.5))
    s.start_window(0)
    s.start_window(1)
    assert s.loads == []
    s.start_window(2)  # perf_counter -> 100
    for step in range(2, 6):
        s.after_step(result(step, step_time=float(step)))
    s.stop_window()  # perf_counter -> 112
    stats = s.stats(steps_done=6, data_prefetched=True)
    assert stats["loop_time_s_per_step"] == pytest.approx(12.0 / 4)
    assert stats["timed_steps"] == 4
    assert stats["load_avg_1m"] == 2.5  # the higher of the two readings
    assert stats["data_prefetched"] is True


def test_speed_counts_each_ranks_page_faults_per_timed_step(monkeypatch):
    """The process's minor faults read just before and just after each timed step (so not
    its batch's making, nor an evaluation or a checkpoint between steps), averaged over the
    steps timed: every rank's ``page_faults_per_step``; none without getrusage."""
    reads = iter([100, 300, 1_000, 1_400])  # steps 2 and 3: 200 and 400
    monkeypatch.setattr(parts, "minor_faults", lambda: next(reads))
    s, _ = speed(monkeypatch, w=windows(timed_from=2))
    for step in range(4):
        s.before_step(step, None)  # steps 0 and 1 are not timed: nothing read
        s.after_step(result(step))
    out = outcome(4)
    s.end(out, None)
    assert s.step_faults == [200, 400] and out.extra["page_faults_per_step"] == 300
    monkeypatch.setattr(parts, "minor_faults", lambda: None)
    s, _ = speed(monkeypatch, w=windows(timed_from=0))
    s.before_step(0, None)
    s.after_step(result(0))
    out = outcome(1)
    s.end(out, None)
    assert "page_faults_per_step" not in out.extra


def test_speed_reports_no_load_where_the_platform_has_none(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=0), clock=(0.0, 1.0), loads=(-1.0, -1.0))
    s.start_window(0)
    s.after_step(result(0))
    s.stop_window()
    assert s.stats(1, False)["load_avg_1m"] is None


def test_speed_has_no_figures_when_no_step_was_timed(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=3), clock=(0.0,))
    s.after_step(result(0))
    s.stop_window()
    assert s.stats(1, False) == {}


def test_speed_compile_time_is_the_first_steps_excess_over_the_median(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=1, compile_step=0), compiled=True, clock=(0.0, 1.0),
                 loads=(1.0, 1.0))  # fmt: skip
    s.start_window(1)
    for step, t in enumerate([5.0, 1.0, 2.0, 3.0]):
        s.after_step(result(step, step_time=t))
    s.stop_window()
    stats = s.stats(4, False)
    assert stats["first_step_s"] == 5.0
    assert stats["compile_s"] == pytest.approx(5.0 - 2.0)


def test_speed_compile_time_is_never_negative(monkeypatch):
    s, _ = speed(monkeypatch, w=windows(timed_from=1, compile_step=0), compiled=True, clock=(0.0, 1.0),
                 loads=(1.0, 1.0))  # fmt: skip
    s.start_window(1)
    for step, t in enumerate([0.5, 1.0, 2.0]):
        s.after_step(result(step, step_time=t))
    s.stop_window()
    assert s.stats(3, False)["compile_s"] == 0.0


# ---------------------------------------------------------------------------- SkippedSteps
def test_skipped_steps_count_the_steps_whose_scale_went_down():
    scales = iter([8.0, 8.0, 8.0, 4.0, 4.0, 8.0, 8.0, 2.0])  # (before, after) of four steps
    strategy = types.SimpleNamespace(scaler=types.SimpleNamespace(get_scale=lambda: next(scales)))
    part = parts.SkippedSteps(strategy)
    for step in range(4):
        part.before_step(step, strategy)
        part.after_step(result(step))
    out = outcome(4)
    part.end(out, None)
    assert out.skipped_steps == 2  # 8 -> 4 and 8 -> 2; a growth (4 -> 8) is no skip


# ---------------------------------------------------------------------------- MemoryWindow
class FakeMeter:
    def __init__(self, device=CPU, tracking=False):
        self.device, self.tracking = device, tracking
        self.ended, self.stops, self.guards, self.pauses = [], 0, 0, 0

    def step_end(self, step):
        self.ended.append(step)

    def stop(self):
        self.stops += 1
        return {"peak_allocated_mib": float(self.stops)}

    @contextlib.contextmanager
    def guard(self, strategy):
        self.guards += 1
        yield

    @contextlib.contextmanager
    def paused(self):
        self.pauses += 1
        yield


def test_memory_window_stops_the_meter_after_its_last_step():
    meter = FakeMeter()
    part = parts.MemoryWindow(meter, None, windows(memory_end=2), compiled=False)
    part.after_step(result(0))
    assert meter.stops == 0
    part.after_step(result(1))  # steps 0 and 1 done: the window ends
    assert meter.stops == 1
    part.after_step(result(2))
    assert meter.ended == [0, 1, 2] and meter.stops == 1
    assert part.result() == {"peak_allocated_mib": 1.0}  # the window's figures, not a later reading


def test_memory_window_reads_the_meter_when_the_loop_stopped_before_its_end():
    meter = FakeMeter()
    part = parts.MemoryWindow(meter, None, windows(memory_end=5), compiled=False)
    part.after_step(result(0))
    assert part.result() == {"peak_allocated_mib": 1.0} and meter.stops == 1


def test_memory_window_resets_dynamo_after_a_compiled_cpu_window(monkeypatch):
    from torch import _dynamo

    resets = []
    monkeypatch.setattr(_dynamo, "reset", lambda: resets.append(1))
    parts.MemoryWindow(FakeMeter(), None, windows(memory_end=1), compiled=True).after_step(result(0))
    assert resets == [1]
    parts.MemoryWindow(FakeMeter(), None, windows(memory_end=1), compiled=False).after_step(result(0))
    parts.MemoryWindow(FakeMeter(torch.device("cuda")), None, windows(memory_end=1), compiled=True).after_step(
        result(0))  # fmt: skip
    assert resets == [1]


# --------------------------------------------------------------------------------- Metrics
class ProbeMeter:
    device = CPU

    def now(self, strategy):
        return (1.0, 2.0, -1.0)


def classifier_result(step, strategy, loss):
    b = batch(step, 0, 0)
    out = strategy.model(**b)
    return StepResult(step, torch.tensor(loss), {"logits": out["logits"].detach()}, [b], 0.1, 0.0)


def test_metrics_publish_at_each_log_interval_and_at_the_last_step(gloo_group):
    strategy, logger = PlainStrategy(TinyClassifier()), ListLogger()
    log = IntervalLog(logger)
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), log, loop_settings(steps=5, log_interval=2), 0, 0)
    losses = [1.0, 3.0, 2.0, 4.0, 6.0]
    for step, loss in enumerate(losses):
        m.after_step(classifier_result(step, strategy, loss))
        m.between_steps(outcome(step + 1), None)
    out = outcome(5)
    m.end(out, None)
    # a record is published one interval late; the end flushes the last
    assert [(r["step"], r["loss"]) for r in log.history] == [(2, 2.0), (4, 3.0), (5, 6.0)]
    assert out.extra["first_nonfinite_step"] == -1


def test_metrics_end_publishes_an_interval_cut_short_by_a_stop(gloo_group):
    strategy = PlainStrategy(TinyClassifier())
    log = IntervalLog(ListLogger())
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), log, loop_settings(steps=10, log_interval=4), 0, 0)
    for step, loss in enumerate([1.0, 1.0, 1.0, 1.0, 5.0, 7.0]):
        m.after_step(classifier_result(step, strategy, loss))
        m.between_steps(outcome(step + 1), None)
    m.end(outcome(6), None)
    assert [(r["step"], r["loss"]) for r in log.history] == [(4, 1.0), (6, 6.0)]


def test_metrics_name_the_first_step_whose_loss_was_not_finite(gloo_group):
    strategy = PlainStrategy(TinyClassifier())
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), IntervalLog(ListLogger()),
                      loop_settings(steps=6, log_interval=3), 0, 0)  # fmt: skip
    for step, loss in enumerate([1.0, 1.0, 1.0, 1.0, float("nan"), float("inf")]):
        m.after_step(classifier_result(step, strategy, loss))
        m.between_steps(outcome(step + 1), None)
    out = outcome(6)
    m.end(out, None)
    assert out.extra["first_nonfinite_step"] == 5  # step index 4, counted from 1


def test_metrics_write_a_line_per_interval_when_the_bar_is_not_on_a_terminal(gloo_group, caplog):
    strategy = PlainStrategy(TinyClassifier())
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), IntervalLog(ListLogger()),
                      loop_settings(steps=4, log_interval=2, progress_bar=True), 0, 0)  # fmt: skip
    assert m.lines  # pytest's captured stderr is no terminal
    with caplog.at_level(logging.INFO, logger="sharded_exp.train.components"):
        for step in range(4):
            m.after_step(classifier_result(step, strategy, 1.5))
            m.between_steps(outcome(step + 1), None)
        out = outcome(4)
        out.loss = torch.tensor(2.25)  # the last step's
        m.end(out, None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "ddp x2: step 2/4 (50%)"  # the interval's record comes one interval late
    # the last step's line is printed once, by the end, with the final loss result.json keeps
    assert lines[1:] == ["ddp x2: step 4/4 (100%), final loss 2.2500"]
    assert out.final_loss == 2.25


def test_a_stopped_run_ends_with_one_line_and_its_final_loss(gloo_group, caplog):
    strategy = PlainStrategy(TinyClassifier())
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), IntervalLog(ListLogger()),
                      loop_settings(steps=10, log_interval=4, progress_bar=True), 0, 0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sharded_exp.train.components"):
        for step in range(6):
            m.after_step(classifier_result(step, strategy, 1.5))
            m.between_steps(outcome(step + 1), None)
        out = outcome(6)
        out.loss = torch.tensor(0.75)
        m.end(out, None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["ddp x2: step 4/10 (40%)", "ddp x2: step 6/10 (60%), final loss 0.7500"]


def test_metrics_show_no_lines_on_ranks_other_than_0(gloo_group):
    strategy = PlainStrategy(TinyClassifier())
    m = parts.Metrics(strategy, tiny_task(), ProbeMeter(), IntervalLog(ListLogger()),
                      loop_settings(progress_bar=True), 0, rank=1)  # fmt: skip
    assert not m.lines and m.bar.disable


# ---------------------------------------------------------------------------------- Faults
def test_faults_pass_each_step_to_the_injector():
    calls = []
    injector = types.SimpleNamespace(before_step=lambda step, strategy: calls.append(("before", step, strategy)),
                                     after_step=lambda: calls.append(("after",)))  # fmt: skip
    part = parts.Faults(injector)
    part.before_step(3, "strategy")
    part.after_step(result(3))
    assert calls == [("before", 3, "strategy"), ("after",)]


# ----------------------------------------------------------------------------- Checkpoints
class FakeManager:
    def __init__(self, every=2, saved_step=None):
        self.every, self.saved_step, self.rss_growth_mib = every, saved_step, 0.5
        self.saves, self.stops, self.finished = [], [], 0

    def due(self, done, steps):
        return done % self.every == 0 or done == steps

    def after_step(self, strategy, done, steps, device, position):
        self.saves.append((done, position))
        self.saved_step = done
        return f"step_{done}"

    def on_stop(self, strategy, done, device, position):
        self.stops.append((done, position))
        return f"stop_{done}"

    def finish(self):
        self.finished += 1


def test_checkpoints_save_when_due_under_the_meters_guard():
    manager, meter = FakeManager(every=2), FakeMeter()
    part = parts.Checkpoints(manager, "strategy", meter, steps=5)
    out = outcome()
    for done in range(1, 6):
        out.steps_done = done
        part.between_steps(out, f"pos{done}")
    assert manager.saves == [(2, "pos2"), (4, "pos4"), (5, "pos5")]
    assert meter.guards == 3
    assert out.checkpoint == "step_5"


def test_checkpoints_save_at_a_stop_unless_that_step_is_saved_already():
    manager, meter = FakeManager(every=4, saved_step=4), FakeMeter()
    part = parts.Checkpoints(manager, "strategy", meter, steps=10)
    out = outcome(6)
    out.stopped = True
    part.end(out, {"samples": 3})
    assert manager.stops == [(6, {"samples": 3})] and out.checkpoint == "stop_6"
    assert manager.finished == 1 and out.extra["checkpoint_rss_growth_mib"] == 0.5

    manager = FakeManager(every=4, saved_step=4)
    out = outcome(4)
    out.stopped = True
    parts.Checkpoints(manager, "strategy", FakeMeter(), steps=10).end(out, None)
    assert manager.stops == [] and manager.finished == 1


def test_checkpoints_do_not_save_at_the_end_of_a_finished_run():
    manager = FakeManager(every=4, saved_step=8)
    out = outcome(10)
    parts.Checkpoints(manager, "strategy", FakeMeter(), steps=10).end(out, None)
    assert manager.stops == [] and manager.finished == 1


def test_checkpoints_do_nothing_at_the_end_without_checkpointing():
    manager = FakeManager(every=0)
    out = outcome(3)
    out.stopped = True
    parts.Checkpoints(manager, "strategy", FakeMeter(), steps=10).end(out, None)
    assert manager.stops == [] and manager.finished == 0 and "checkpoint_rss_growth_mib" not in out.extra


# ------------------------------------------------------------------------------ Evaluation
def evaluation(every=2, steps=6, tracking=False, evaluate=None):
    calls, meter, log = [], FakeMeter(tracking=tracking), IntervalLog(ListLogger())

    def default(step):
        calls.append(step)
        return {"eval/loss": float(step), "other": 1.0}

    return parts.Evaluation(evaluate or default, every, meter, log, steps), calls, meter, log


def test_evaluation_runs_every_n_steps_but_not_at_the_last_which_is_the_final_pass():
    part, calls, meter, log = evaluation(every=2, steps=6)
    out = outcome()
    for done in range(1, 7):
        out.steps_done = done
        part.between_steps(out, None)
    assert calls == [2, 4]
    assert [e["step"] for e in out.evals] == [2, 4] and out.evals[0]["eval/loss"] == 2.0
    assert meter.pauses == 2
    assert [(s, v) for s, v in log._pending] == [(2, {"eval/loss": 2.0}), (4, {"eval/loss": 4.0})]  # eval/ only


def test_evaluation_never_runs_inside_the_memory_trackers_window_nor_when_off():
    part, calls, _, _ = evaluation(every=1, steps=6, tracking=True)
    part.between_steps(outcome(1), None)
    part, calls_off, _, _ = evaluation(every=0, steps=6)
    part.between_steps(outcome(2), None)
    assert calls == [] and calls_off == []


def test_the_final_evaluation_runs_once_training_finished_and_not_after_a_stop():
    part, calls, _, _ = evaluation(every=0, steps=6)
    out = outcome(6)
    part.final(out)
    assert calls == [6] and out.evals[0]["step"] == 6
    stopped = outcome(3)
    stopped.stopped = True
    part.final(stopped)
    assert calls == [6] and stopped.evals == []


def test_an_out_of_memory_in_the_final_evaluation_says_where_it_happened():
    def oom(step):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    part, _, _, _ = evaluation(evaluate=oom)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory in the final evaluation, after training"):
        part.final(outcome(6))

    def other(step):
        raise ValueError("not a memory problem")

    part, _, _, _ = evaluation(evaluate=other)
    with pytest.raises(ValueError, match="^not a memory problem$"):
        part.final(outcome(6))


# ------------------------------------------------------------------------ the tracker's start
def test_the_trackers_start_is_waited_for_by_every_rank_after_the_warm_up_only(monkeypatch):
    calls = []
    logger = types.SimpleNamespace(wait_started=lambda: calls.append("waited"))
    monkeypatch.setattr(parts.dist, "barrier", lambda: calls.append("barrier"))
    part = parts.TrackerStart(logger, at=Windows.plan(LoopSettings(10, 3, 4, 1, 0.0, 5), 0,
                                                      torch.device("cpu"), profiling=False).profile_from)  # fmt: skip
    out = types.SimpleNamespace(steps_done=0)
    for done in range(1, 11):
        out.steps_done = done
        part.between_steps(out, None)
        if done == 3:  # the warm-up's last step: waited for here, before the first timed step
            assert calls == ["waited", "barrier"]
    assert calls == ["waited", "barrier"]  # once
