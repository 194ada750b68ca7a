"""sharded_exp.launch.parent: how a failure is laid over a job's result (the earliest rank's
record, a rank that died, a signal, an out-of-memory), each field keeping its place."""

from __future__ import annotations

import json
import signal

from sharded_exp.job.result import Result
from sharded_exp.launch import parent


def running(**fields) -> Result:
    base = {"status": "running", "error": None, "strategy": "ddp", "precision": "32", "model": "mlp",
            "optimizer": "adam", "output_dir": "/out", "config": {}}  # fmt: skip
    return Result.of({**base, **fields})


def test_the_earliest_rank_record_names_the_failure_with_its_traceback(tmp_path):
    for rank, (time, error) in enumerate([(2.0, "rank 0: ConnectionError: peer"), (1.0, "rank 1: ValueError: bad")]):
        (tmp_path / f"rank{rank}_error.json").write_text(json.dumps({"time": time, "error": error, "traceback": "tb"}))
    result = parent.failed(running(), RuntimeError("lost"), str(tmp_path))
    assert (result.status, result.error, result.traceback) == ("failed", "rank 1: ValueError: bad", "tb")
    assert list(result.as_written())[:3] == ["schema_version", "status", "error"]  # in place, not appended


def test_a_rank_that_died_is_named_without_reading_the_records(tmp_path):
    result = parent.failed(running(), parent.RankDied(1, -signal.SIGKILL), str(tmp_path))
    assert result.status == "failed" and result.error.startswith("rank 1: killed by signal 9 (SIGKILL)")
    assert not result.has("traceback")


def test_a_stop_keeps_its_signal_and_an_allocation_failure_is_oom(tmp_path):
    stopped = parent.failed(running(), parent.Stopped(signal.SIGTERM, killed=None), str(tmp_path))
    assert (stopped.status, stopped.signal) == ("stopped", signal.SIGTERM)
    (tmp_path / "rank0_error.json").write_text(
        json.dumps({"time": 1.0, "error": "rank 0: OutOfMemoryError: CUDA out of memory", "traceback": "tb"})
    )
    assert parent.failed(running(), RuntimeError("x"), str(tmp_path)).status == "oom"
