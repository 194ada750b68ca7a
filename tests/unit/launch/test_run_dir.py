"""sharded_exp.launch.run_dir: a run directory held by one live job, its lock let go, an
earlier attempt's records moved aside (and nothing else), Hydra's files written."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.errors import RunDirInUse
from sharded_exp.job.result import TRAINED
from sharded_exp.launch import run_dir


def test_a_held_run_directory_refuses_a_second_holder_until_released(tmp_path):
    held = run_dir.hold_run_dir(str(tmp_path))
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(
        RunDirInUse, match=rf"run directory {tmp_path} is in use by a running job \(pid {os.getpid()}\)"
    ):
        run_dir.hold_run_dir(str(tmp_path))  # another open file: flock refuses it as it would another process
    run_dir.release_run_dir(None, held, held)  # None and a lock already let go are skipped
    assert held.closed and not (tmp_path / ".lock").exists()
    run_dir.release_run_dir(run_dir.hold_run_dir(str(tmp_path)))  # free again


def test_an_earlier_attempt_moves_to_the_next_number_and_checkpoints_stay(tmp_path):
    for name in ("result.json", "rank1_error.json", "sharded_exp.log"):
        (tmp_path / name).write_text("earlier")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "attempts" / "2").mkdir(parents=True)
    target = run_dir.archive_previous_attempt(str(tmp_path), extra=(".hydra",))
    assert target == str(tmp_path / "attempts" / "3")
    assert sorted(os.listdir(target)) == [".hydra", "rank1_error.json", "result.json"]
    assert sorted(os.listdir(tmp_path)) == ["attempts", "checkpoints", "sharded_exp.log"]
    assert run_dir.archive_previous_attempt(str(tmp_path)) is None  # nothing left to move
    assert run_dir.archive_previous_attempt(str(tmp_path / "absent")) is None


def test_an_attempt_moved_aside_comes_back_as_it_was(tmp_path):
    for name in ("result.json", "rank1_error.json"):
        (tmp_path / name).write_text("earlier")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("a: 1")
    target = run_dir.archive_previous_attempt(str(tmp_path), extra=(".hydra",))
    run_dir.restore_attempt(str(tmp_path), target)  # the job was refused after its ranks started
    assert sorted(os.listdir(tmp_path)) == [".hydra", "rank1_error.json", "result.json"]  # attempts/ gone
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "a: 1"
    (tmp_path / "attempts" / "1").mkdir(parents=True)  # an older attempt stays where it is
    run_dir.restore_attempt(str(tmp_path), run_dir.archive_previous_attempt(str(tmp_path), extra=(".hydra",)))
    assert sorted(os.listdir(tmp_path / "attempts")) == ["1"] and (tmp_path / "result.json").exists()
    run_dir.restore_attempt(str(tmp_path), None)  # nothing was moved
    target = run_dir.archive_previous_attempt(str(tmp_path), extra=(".hydra",))
    (tmp_path / "rank1_error.json").write_text("this attempt's")  # a rank failed while it waited
    run_dir.restore_attempt(str(tmp_path), target)
    assert (tmp_path / "rank1_error.json").read_text() == "this attempt's"  # kept, not overwritten
    assert os.listdir(target) == ["rank1_error.json"] and (tmp_path / "result.json").exists()


def test_job_files_are_written_under_hydra(tmp_path):
    run_dir.write_job_files(str(tmp_path), {"overrides.yaml": OmegaConf.create(["trainer.steps=2"])})
    assert OmegaConf.load(tmp_path / ".hydra" / "overrides.yaml") == ["trainer.steps=2"]
    run_dir.write_job_files(str(tmp_path / "none"), {})
    assert not (tmp_path / "none").exists()


def test_rank_zeros_training_record_is_removed_if_there(tmp_path):
    (tmp_path / TRAINED).write_text("{}")
    run_dir.remove_trained(str(tmp_path))
    assert not (tmp_path / TRAINED).exists()
    run_dir.remove_trained(str(tmp_path))  # already gone: nothing to do


def test_a_held_checkpoint_directory_loses_its_unfinished_saves(tmp_path):
    ckpts = tmp_path / "ckpts"
    (ckpts / ".step_00000002.tmp.123").mkdir(parents=True)  # a save killed mid-way
    (ckpts / "step_00000001").mkdir()
    plan = CheckpointPlan(directory=str(ckpts), format="consolidated", every=1, keep=0, asynchronous=False,
                          existing="refuse", resume=None, start_step=0)  # fmt: skip
    held = run_dir.hold_checkpoints(plan)
    try:
        assert sorted(os.listdir(ckpts)) == [".lock", "step_00000001"]
    finally:
        run_dir.release_run_dir(held)
