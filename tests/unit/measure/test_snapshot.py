"""sharded_exp.measure.snapshot: when the CUDA allocator's history is recorded (the
``trainer.memory_snapshot`` modes), where its file goes, and the guarded record / dump /
stop calls (torch's private calls replaced here: no GPU)."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.config import MemorySnapshot
from sharded_exp.measure import snapshot
from sharded_exp.measure.snapshot import MAX_ENTRIES, MemoryHistory, _mode, snapshot_path

CUDA = torch.device("cuda", 0)


def test_each_rank_has_its_own_snapshot_file(tmp_path):
    assert snapshot_path(str(tmp_path), 3) == str(tmp_path / "memory_snapshot_rank3.pickle")


@pytest.mark.parametrize(
    "setting, limit, mode",
    [
        ("auto", 512.0, "oom"),  # a budget: is it enough? record, dump on OOM
        ("auto", None, "off"),
        ("auto", 0, "off"),
        (MemorySnapshot.auto, 1.0, "oom"),  # a composed config holds the enum
        ("oom", None, "oom"),
        ("always", None, "always"),
        (MemorySnapshot.off, 512.0, "off"),
    ],
)
def test_the_mode_follows_the_setting_and_auto_the_budget(setting, limit, mode):
    assert _mode(setting, limit) == mode


@pytest.fixture
def allocator(monkeypatch):
    """torch.cuda.memory's history calls replaced: each call recorded; ``fail`` makes one raise."""
    calls, fail = [], set()

    def record(*args, **kwargs):
        if "record" in fail:
            raise RuntimeError("no allocator here")
        calls.append(("record", args, kwargs))

    def dump(path):
        if "dump" in fail:
            raise OSError("disk full")
        calls.append(("dump", path))

    monkeypatch.setattr(snapshot.torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(snapshot.torch.cuda.memory, "_dump_snapshot", dump)
    return calls, fail


def test_nothing_is_recorded_on_cpu_and_it_says_why(tmp_path, allocator):
    calls, _ = allocator
    history = MemoryHistory("always", torch.device("cpu"), 512.0, str(tmp_path), 0)
    history.dump()
    history.stop()
    assert calls == [] and not history.recorded
    assert history.record() == {"setting": "always", "recorded": False, "path": None, "reason": history.reason}
    assert "no CUDA allocator to record on CPU" in history.reason


@pytest.mark.parametrize(
    "setting, reason",
    [("auto", "not recorded (no trainer.memory_limit_mib)"), ("off", "not recorded (trainer.memory_snapshot=off)")],
)
def test_an_off_mode_records_nothing_and_names_the_setting(tmp_path, allocator, setting, reason):
    calls, _ = allocator
    history = MemoryHistory(setting, CUDA, None, str(tmp_path), 0)
    assert calls == [] and history.record()["reason"] == reason


def test_a_recording_rank_records_python_stacks_dumps_once_and_stops(tmp_path, allocator):
    calls, _ = allocator
    history = MemoryHistory(MemorySnapshot.oom, CUDA, None, str(tmp_path), 1)
    assert history.recording and history.recorded and history.setting == "oom"
    assert calls[0] == ("record", ("all",), {"context": "all", "stacks": "python", "max_entries": MAX_ENTRIES})
    assert history.record()["reason"] == "no out-of-memory: nothing to dump"
    history.dump()
    history.dump()  # once only
    history.stop()
    history.stop()  # stopped once
    path = str(tmp_path / "memory_snapshot_rank1.pickle")
    assert calls[1:] == [("dump", path), ("record", (None,), {})]
    assert history.record() == {"setting": "oom", "recorded": True, "path": path, "reason": None}
    assert not history.recording


def test_a_stopped_history_dumps_nothing(tmp_path, allocator):
    calls, _ = allocator
    history = MemoryHistory("always", CUDA, None, str(tmp_path), 0)
    history.stop()
    history.dump()
    assert [c[0] for c in calls] == ["record", "record"] and history.record()["path"] is None


def test_a_failing_record_call_leaves_its_reason_and_no_file(tmp_path, allocator):
    calls, fail = allocator
    fail.add("record")
    history = MemoryHistory("oom", CUDA, None, str(tmp_path), 0)
    history.dump()
    assert not history.recorded and calls == []
    assert history.record()["reason"] == "could not record the allocator's history: RuntimeError: no allocator here"


def test_a_failing_dump_leaves_its_reason(tmp_path, allocator):
    _, fail = allocator
    history = MemoryHistory("oom", CUDA, None, str(tmp_path), 2)
    fail.add("dump")
    history.dump()
    record = history.record()
    assert record["recorded"] is True and record["path"] is None
    assert record["reason"] == f"could not write {tmp_path / 'memory_snapshot_rank2.pickle'}: OSError: disk full"
