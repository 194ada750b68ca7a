"""The suite's shared jobs (tests/helpers/jobs.py's SharedRuns): a job several tests ask for
runs once per session, also when the asking tests are on different xdist workers."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import jobs


class _Factory:
    def __init__(self, base):
        self._base = base

    def getbasetemp(self):
        return self._base


def test_a_job_asked_for_by_two_workers_at_once_runs_once_and_both_read_its_result(tmp_path, monkeypatch):
    """Two workers (each its own SharedRuns, its own lock file handle: flock holds between
    them as between processes) ask for one job while it runs; a third asks afterwards."""
    launched = []

    def fake_launch(overrides, out, env=None):
        launched.append(list(overrides))
        (out / "result.json").write_text("{}")
        time.sleep(0.2)  # the other worker most likely asks meanwhile (either way it must not run it)
        return {"status": "ok", "final_loss": 0.5, "out": str(out)}

    monkeypatch.setattr(jobs, "launch_job", fake_launch)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    for i in range(3):
        (tmp_path / f"popen-gw{i}").mkdir()
    workers = [jobs.SharedRuns(_Factory(tmp_path / f"popen-gw{i}")) for i in range(3)]
    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, workers[i]("strategy=fsdp"))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    later = workers[2]("strategy=fsdp")
    assert launched == [["strategy=fsdp"]]
    assert got[0] == got[1] == later
    out, result = later
    assert out.parent == tmp_path / "shared_runs" and (out / "result.json").exists()
    assert result == {"status": "ok", "final_loss": 0.5, "out": str(out)}
    # another job, or the same with another environment, is its own
    workers[0]("strategy=ddp")
    workers[1]("strategy=fsdp", env={"X": "1"})
    assert launched == [["strategy=fsdp"], ["strategy=ddp"], ["strategy=fsdp"]]


def test_a_job_that_raised_is_run_again_by_the_next_worker_that_asks(tmp_path, monkeypatch):
    calls = []

    def flaky_launch(overrides, out, env=None):
        calls.append(sorted(p.name for p in out.iterdir()))
        if len(calls) == 1:
            (out / "partial").write_text("")
            raise RuntimeError("rank 1 died")
        return {"status": "ok"}

    monkeypatch.setattr(jobs, "launch_job", flaky_launch)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    first, second = jobs.SharedRuns(_Factory(tmp_path)), jobs.SharedRuns(_Factory(tmp_path))
    with pytest.raises(RuntimeError, match="rank 1 died"):
        first("model=gpt")
    assert second("model=gpt")[1] == {"status": "ok"}
    assert calls == [[], []]  # the second try starts in an empty directory
