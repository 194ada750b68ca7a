"""sharded_exp.launch.diagnose: how a failure is laid over a job's result (the earliest rank's
record, a rank that died, a signal, an out-of-memory), each field keeping its place, and what
a failed job keeps (training figures, the prediction, the checkpoint to resume)."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

from sharded_exp.job.result import TRAINED, Result
from sharded_exp.launch import diagnose
from sharded_exp.launch.supervise import RankDied, Stopped


def running(**fields) -> Result:
    base = {"status": "running", "error": None, "strategy": "ddp", "precision": "32", "model": "mlp",
            "optimizer": "adam", "output_dir": "/out", "config": {}}  # fmt: skip
    return Result.of({**base, **fields})


def spec(output_dir, every=0, directory=None, limit=None):
    """The parts of a JobSpec that a failure reads."""
    prediction = {"model_states_mib": [{"params": 1.0, "grads": 1.0}], "transient_params_mib": 0.0}
    return SimpleNamespace(
        output_dir=str(output_dir), device_type="cpu", prediction=prediction,
        config={"trainer": {"memory_limit_mib": limit}},
        checkpoint=SimpleNamespace(every=every, directory=directory and str(directory)),
    )  # fmt: skip


def test_the_earliest_rank_record_names_the_failure_with_its_traceback(tmp_path):
    for rank, (time, error) in enumerate([(2.0, "rank 0: ConnectionError: peer"), (1.0, "rank 1: ValueError: bad")]):
        (tmp_path / f"rank{rank}_error.json").write_text(json.dumps({"time": time, "error": error, "traceback": "tb"}))
    result = diagnose.failed(running(), RuntimeError("lost"), str(tmp_path))
    assert (result.status, result.error, result.traceback) == ("failed", "rank 1: ValueError: bad", "tb")
    assert list(result.as_written())[:3] == ["schema_version", "status", "error"]  # in place, not appended


def test_a_failed_job_says_how_many_steps_its_first_failing_rank_had_done(tmp_path):
    """The rank's record counts the steps it completed (set after each step, so a failure in a
    checkpoint between steps or in the final evaluation has them all; 0 in the first step of a
    fresh run); a failure before the loop (the build) says none; training's own figures (a
    failure after them) are kept as they are."""
    for done in (3, 0, None):
        record = {"time": 1.0, "error": "rank 1: ValueError: bad", "traceback": "tb", "step": 2, "steps_done": done}
        (tmp_path / "rank1_error.json").write_text(json.dumps(record))
        result = diagnose.failed(running(), RuntimeError("x"), str(tmp_path))
        assert (result.steps_done if result.has("steps_done") else None) == done
    (tmp_path / "rank1_error.json").write_text(json.dumps(record | {"steps_done": 3}))
    assert diagnose.failed(running(steps_done=8), RuntimeError("x"), str(tmp_path)).steps_done == 8


def test_a_rank_that_died_is_named_without_reading_the_records(tmp_path):
    (tmp_path / "rank0_error.json").write_text(json.dumps({"time": 1.0, "error": "rank 0: lost", "traceback": "tb"}))
    result = diagnose.failed(running(), RankDied(1, -signal.SIGKILL), str(tmp_path))
    assert result.status == "failed" and result.error.startswith("rank 1: killed by signal 9 (SIGKILL)")
    assert not result.has("traceback")


def test_a_stop_keeps_its_signal_and_an_allocation_failure_is_oom(tmp_path):
    stopped = diagnose.failed(running(), Stopped(signal.SIGTERM, killed=None), str(tmp_path))
    assert (stopped.status, stopped.signal) == ("stopped", signal.SIGTERM)
    (tmp_path / "rank0_error.json").write_text(
        json.dumps({"time": 1.0, "error": "rank 0: OutOfMemoryError: CUDA out of memory", "traceback": "tb"})
    )
    assert diagnose.failed(running(), RuntimeError("x"), str(tmp_path)).status == "oom"


def test_an_exception_without_a_record_is_described_in_one_line():
    assert diagnose.describe_failure(ValueError("bad value")) == "ValueError: bad value"
    assert diagnose.describe_failure(RankDied(2, 3)) == "rank 2: process exited with code 3"


def test_a_failure_after_training_keeps_the_training_figures_but_not_their_status(tmp_path):
    (tmp_path / TRAINED).write_text(json.dumps({"status": "ok", "error": None, "steps": 7, "timeline": {}}))
    assert diagnose.kept_training(str(tmp_path)) == {"steps": 7}
    assert diagnose.kept_training(str(tmp_path / "absent")) == {}


def test_a_failed_job_keeps_its_prediction_and_says_where_the_limit_applies(tmp_path):
    result = diagnose.failure_result(running(), RuntimeError("boom"), spec(tmp_path, limit=100.0))
    assert (result.status, result.error) == ("failed", "RuntimeError: boom")
    memory = result.as_written()["memory"]
    assert memory["predicted_model_states_mib_max"] == 2.0
    assert memory["memory_limit_applies_to"] is not None
    unlimited = diagnose.failure_result(running(), RuntimeError("boom"), spec(tmp_path))
    assert unlimited.as_written()["memory"]["memory_limit_applies_to"] is None
    assert not unlimited.has("checkpoint")  # no checkpoints, no stop: nothing to name


def test_a_stopped_job_names_its_newest_complete_checkpoint(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (2, 4):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
        (ckpts / f"step_{step:08d}" / "meta.json").write_text("{}")
    (ckpts / "step_00000006").mkdir()  # no meta.json: incomplete
    stopped = Stopped(signal.SIGTERM, killed=None)
    result = diagnose.failure_result(running(), stopped, spec(tmp_path, directory=ckpts))
    assert (result.status, result.checkpoint) == ("stopped", str(ckpts / "step_00000004"))
    none_yet = diagnose.failure_result(running(), stopped, spec(tmp_path, directory=tmp_path / "absent"))
    assert none_yet.has("checkpoint") and none_yet.checkpoint is None
