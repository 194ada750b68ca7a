"""sharded_exp.measure.profile: which steps the profiler covers, when it starts and
stops, the trace's record in result.json, and its failures (never the training's).
torch.profiler is replaced by a stub here (a real one takes a second to start)."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.measure.profile import StepProfiler, trace_path

CPU = torch.device("cpu")


class StubProfile:
    """torch.profiler.profile: records start, stop and the export; ``fail`` one of them."""

    made: list = []
    fail: str | None = None

    def __init__(self, activities):
        self.activities = activities
        self.events: list[str] = []
        StubProfile.made.append(self)

    def start(self):
        if self.fail == "start":
            raise RuntimeError("kineto unavailable")
        self.events.append("start")

    def stop(self):
        self.events.append("stop")

    def export_chrome_trace(self, path):
        if self.fail == "export":
            raise OSError("read-only")
        self.events.append("export")
        with open(path, "w") as f:
            f.write("{}" + " " * 1022)  # 1 KiB


@pytest.fixture
def stub(monkeypatch):
    import torch.profiler

    StubProfile.made, StubProfile.fail = [], None
    monkeypatch.setattr(torch.profiler, "profile", StubProfile)
    return StubProfile


def run_steps(profiler: StepProfiler, steps) -> None:
    for step in steps:
        profiler.before_step(step)
        with profiler.label(step):
            pass
        profiler.after_step(step, 0.1 * step)


def test_each_rank_writes_its_own_trace(tmp_path):
    assert trace_path(str(tmp_path), 2) == str(tmp_path / "trace_rank2.json")


def test_the_profiler_covers_count_steps_from_first():
    profiler = StepProfiler(CPU, "x.json", first=3, count=2)
    assert [s for s in range(8) if profiler.covers(s)] == [3, 4]


def test_the_profiled_steps_are_traced_and_written_after_the_last(stub, tmp_path):
    path = str(tmp_path / "trace_rank0.json")
    profiler = StepProfiler(CPU, path, first=2, count=2)
    run_steps(profiler, range(6))
    [prof] = stub.made
    assert prof.events == ["start", "stop", "export"]
    assert [a.name for a in prof.activities] == ["CPU"]  # no CUDA activity on a CPU rank
    record = profiler.record()
    assert record["path"] == path and record["steps"] == [2, 3]
    assert record["step_time_s"] == pytest.approx([0.2, 0.3])
    assert record["size_mib"] == pytest.approx(1024 / 2**20) and record["error"] is None
    assert record["export_s"] is not None


def test_a_cuda_rank_profiles_cuda_activity_too(stub, tmp_path):
    profiler = StepProfiler(torch.device("cuda", 0), str(tmp_path / "t.json"), first=0, count=1)
    profiler.before_step(0)
    assert [a.name for a in stub.made[0].activities] == ["CPU", "CUDA"]


def test_a_loop_that_stops_inside_the_window_still_writes_its_trace(stub, tmp_path):
    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=1, count=5)
    run_steps(profiler, range(3))
    assert stub.made[0].events == ["start"]
    profiler.finish()
    profiler.finish()  # once only
    assert stub.made[0].events == ["start", "stop", "export"]
    assert profiler.record()["steps"] == [1, 2] and profiler.record()["error"] is None


def test_no_profiled_steps_is_the_notes_reason(stub, tmp_path):
    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=1, count=0, note="trainer.profile_steps=0")
    run_steps(profiler, range(3))
    assert stub.made == []
    assert profiler.record()["error"] == "trainer.profile_steps=0" and profiler.record()["path"] is None


def test_a_window_never_reached_says_no_step_ran(stub, tmp_path):
    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=10, count=2)
    run_steps(profiler, range(3))
    profiler.finish()
    record = profiler.record()
    assert stub.made == [] and record["path"] is None and record["error"] == "no profiled step ran"


def test_a_profiler_that_cannot_start_leaves_its_reason_and_the_steps_go_on(stub, tmp_path):
    stub.fail = "start"
    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=0, count=2)
    run_steps(profiler, range(3))
    record = profiler.record()
    assert record["path"] is None and record["steps"] == []
    assert record["error"] == "the profiler could not start: RuntimeError: kineto unavailable"


def test_a_trace_that_cannot_be_written_leaves_its_reason(stub, tmp_path):
    stub.fail = "export"
    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=0, count=1)
    run_steps(profiler, range(2))
    record = profiler.record()
    assert record["path"] is None and record["size_mib"] is None and record["steps"] == [0]
    assert record["error"] == "the profiler could not write its trace: OSError: read-only"


def test_only_profiled_steps_are_labelled_in_the_trace(stub, tmp_path):
    import contextlib

    profiler = StepProfiler(CPU, str(tmp_path / "t.json"), first=1, count=1)
    assert isinstance(profiler.label(1), contextlib.nullcontext)  # not started yet
    profiler.before_step(1)
    label = profiler.label(1)
    assert isinstance(label, torch.profiler.record_function) and label.name == "step 1"
    assert isinstance(profiler.label(2), contextlib.nullcontext)
