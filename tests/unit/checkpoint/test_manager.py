"""sharded_exp.checkpoint.manager: when the loop's checkpoints are written (due steps, a stop,
the last step), what a save writes (meta.json's record, the temporary directory, keep-k, an
existing checkpoint kept) and the dcp save finished later; run in one process on a
world-size-1 gloo group."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sharded_exp.checkpoint.manager import CheckpointManager, _dcp_failure, load
from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.checkpoint.state import local_optimizer_state, restore
from sharded_exp.checkpoint.storage import complete_checkpoints, read_meta

CPU = torch.device("cpu")
JOB = {"strategy": "ddp", "precision": "32", "optimizer": "adam", "model": {"name": "tiny"}}


def make_plan(directory, every=3, keep=0, fmt="consolidated", asynchronous=False, resume=None) -> CheckpointPlan:
    return CheckpointPlan(str(directory), fmt, every, keep, asynchronous, "refuse", resume, 0)


def saved_steps(directory) -> list[int]:
    return [s for s, _ in complete_checkpoints(str(directory))]


# ---------------------------------------------------------------------------- due
@pytest.mark.parametrize(
    "every, steps, due",
    [
        (3, 7, [3, 6, 7]),  # periodic, and the last step
        (3, 6, [3, 6]),  # the last step is periodic too: once
        (10, 4, [4]),  # fewer steps than the period: the last one only
        (1, 3, [1, 2, 3]),
        (0, 5, []),  # no checkpoints
    ],
)
def test_due_steps_are_the_multiples_of_every_and_the_last_step(every, steps, due):
    manager = CheckpointManager(make_plan("/unused", every=every), JOB)
    assert [s for s in range(1, steps + 1) if manager.due(s, steps)] == due


# --------------------------------------------------------------------- the schedule
def test_after_step_writes_exactly_the_due_checkpoints(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path, every=3), JOB)
    returned = [manager.after_step(strategy, s, 7, CPU, lambda: None) for s in range(1, 8)]
    assert saved_steps(tmp_path) == [3, 6, 7]
    assert [os.path.basename(r) if r else None for r in returned] == [
        None, None, "step_00000003", None, None, "step_00000006", "step_00000007"
    ]  # fmt: skip
    assert manager.saved_step == 7


def test_after_step_asks_the_data_position_only_when_saving_and_records_it(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path, every=2), JOB)
    asked = []

    def position():
        asked.append(True)
        return {"epoch": 1, "samples": 40}

    manager.after_step(strategy, 1, 10, CPU, position)
    assert asked == []
    manager.after_step(strategy, 2, 10, CPU, position)
    assert asked == [True]
    assert read_meta(str(tmp_path / "step_00000002"))["data"] == {"epoch": 1, "samples": 40}


def test_on_stop_saves_the_state_at_the_stop(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path, every=5), JOB)
    manager.after_step(strategy, 4, 20, CPU, lambda: None)  # not due
    path = manager.on_stop(strategy, 4, CPU, None)
    assert path == str(tmp_path / "step_00000004")
    assert saved_steps(tmp_path) == [4]


def test_on_stop_right_after_a_checkpoint_writes_nothing_more(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path, every=5), JOB)
    manager.after_step(strategy, 5, 20, CPU, lambda: None)
    assert manager.on_stop(strategy, 5, CPU, None) is None
    assert saved_steps(tmp_path) == [5]
    assert manager.on_stop(strategy, 6, CPU, None) == str(tmp_path / "step_00000006")  # a step later: saved


def test_a_job_without_checkpoints_never_saves(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path / "ckpt", every=0), JOB)
    assert manager._group is None and manager._token == ""
    assert manager.after_step(strategy, 5, 5, CPU, lambda: None) is None
    assert manager.on_stop(strategy, 3, CPU, None) is None
    assert not (tmp_path / "ckpt").exists()


def test_load_of_a_fresh_plan_starts_at_step_zero_without_changes(make_strategy, tmp_path):
    assert load(make_plan(tmp_path, resume=None), make_strategy(), CPU) == {"step": 0, "resume_changes": []}


# ------------------------------------------------------------------- what a save writes
def test_meta_json_records_the_job_the_step_and_every_shape(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path), JOB)
    path = manager.save(strategy, 3, CPU)
    meta = read_meta(path)
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["format"] == 1
    assert meta["checkpoint_format"] == "consolidated"
    assert {k: meta[k] for k in JOB} == JOB
    assert meta["param_shapes"] == {"0.weight": [4, 3], "0.bias": [4], "2.weight": [2, 4]}
    assert "data" not in meta
    assert set(os.listdir(path)) == {"model.pt", "optim.pt", "train.pt", "meta.json"}


def test_an_existing_checkpoint_of_the_same_step_is_kept_not_overwritten(gloo_group, make_strategy, tmp_path, capsys):
    manager = CheckpointManager.create(make_plan(tmp_path), JOB)
    path = manager.save(make_strategy(seed=1), 3, CPU)
    before = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert manager.save(make_strategy(seed=2), 3, CPU) == path
    after = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "exists already: kept, not overwritten" in capsys.readouterr().err


def test_keep_leaves_the_newest_checkpoints(gloo_group, make_strategy, tmp_path):
    strategy = make_strategy()
    manager = CheckpointManager.create(make_plan(tmp_path, every=2, keep=2), JOB)
    for step in range(1, 9):
        manager.after_step(strategy, step, 8, CPU, lambda: None)
    assert saved_steps(tmp_path) == [6, 8]


def test_a_save_writes_into_a_temporary_directory_of_this_job_first(gloo_group, make_strategy, tmp_path):
    seen = []

    def during_write(rank, step):
        seen.append((rank, step, sorted(os.listdir(tmp_path))))

    manager = CheckpointManager.create(make_plan(tmp_path), JOB, during_write)
    manager.save(make_strategy(), 4, CPU)
    [(rank, step, names)] = seen
    assert (rank, step) == (0, 4)
    assert names == [f".step_00000004.tmp.{manager._token}"]  # not yet published
    assert manager._token.startswith(f"{os.getpid()}-")


def test_a_save_that_fails_midway_leaves_nothing_behind(gloo_group, make_strategy, tmp_path):
    def during_write(rank, step):
        raise OSError("disk gone")

    manager = CheckpointManager.create(make_plan(tmp_path), JOB, during_write)
    with pytest.raises(OSError, match="disk gone"):
        manager.save(make_strategy(), 4, CPU)
    assert os.listdir(tmp_path) == []


def test_a_consolidated_save_resumes_into_a_fresh_strategy(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1, steps=2)
    path = CheckpointManager.create(make_plan(tmp_path), JOB).save(source, 2, CPU)
    target = make_strategy(seed=2, steps=0)
    meta = restore(target, path, CPU)
    assert meta["step"] == 2 and meta["resume_changes"] == []
    for k, v in source.module.state_dict().items():
        assert torch.equal(target.module.state_dict()[k], v)


# ------------------------------------------------------------------------------- dcp
def _assert_same_state(source, target):
    for k, v in source.module.state_dict().items():
        assert torch.equal(target.module.state_dict()[k], v), k
    want, got = local_optimizer_state(source), local_optimizer_state(target)
    assert set(got) == set(want)
    for name in want:
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def test_a_dcp_save_is_published_complete_and_resumes(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1, steps=2)
    manager = CheckpointManager.create(make_plan(tmp_path, fmt="dcp"), JOB)
    path = manager.save(source, 2, CPU)
    assert manager._pending is None
    assert {".metadata", "train.pt", "meta.json"} <= set(os.listdir(path))
    assert read_meta(path)["checkpoint_format"] == "dcp"
    target = make_strategy(seed=2, steps=0)
    restore(target, path, CPU)
    _assert_same_state(source, target)


def test_an_asynchronous_dcp_save_is_published_only_when_finished(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1, steps=1)
    manager = CheckpointManager.create(make_plan(tmp_path, fmt="dcp", asynchronous=True), JOB)
    path = manager.save(source, 1, CPU)
    assert path == str(tmp_path / "step_00000001")
    assert not os.path.exists(path)  # meta.json and the rename wait for finish()
    manager.finish()
    assert saved_steps(tmp_path) == [1]
    with open(os.path.join(path, "meta.json")) as f:
        assert json.load(f)["step"] == 1
    manager.finish()  # nothing in flight: nothing happens
    assert saved_steps(tmp_path) == [1]


def test_the_next_save_finishes_the_asynchronous_one_in_flight(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1, steps=1)
    manager = CheckpointManager.create(make_plan(tmp_path, fmt="dcp", asynchronous=True, keep=0), JOB)
    manager.save(source, 1, CPU)
    manager.save(source, 2, CPU)
    assert saved_steps(tmp_path) == [1]  # step 2 still in flight
    manager.finish()
    assert saved_steps(tmp_path) == [1, 2]


# ---------------------------------------------------------------- a failed dcp save
def test_a_failed_dcp_save_removes_its_directory_and_reraises(tmp_path):
    tmp = tmp_path / ".step_00000001.tmp.job"
    tmp.mkdir()
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        with _dcp_failure(str(tmp)):
            raise RuntimeError("rank 1 failed")
    assert not tmp.exists()


@pytest.mark.parametrize("message", ["[Errno 28] while writing", "OSError: No space left on device"])
def test_a_dcp_save_that_fills_the_disk_says_so_in_one_line(tmp_path, message):
    import errno

    tmp = tmp_path / ".step_00000001.tmp.job"
    tmp.mkdir()
    with pytest.raises(OSError, match=f"no space left on device while writing {tmp}") as caught:
        with _dcp_failure(str(tmp)):
            raise RuntimeError(message)  # DCP wraps every rank's exception: the errno survives in the text
    assert caught.value.errno == errno.ENOSPC
    assert not tmp.exists()


def test_an_interrupted_dcp_save_removes_its_directory_and_stays_an_interrupt(tmp_path):
    tmp = tmp_path / ".step_00000001.tmp.job"
    tmp.mkdir()
    with pytest.raises(KeyboardInterrupt):
        with _dcp_failure(str(tmp)):
            raise KeyboardInterrupt
    assert not tmp.exists()
