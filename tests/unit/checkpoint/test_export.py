"""sharded_exp.checkpoint.export: a dcp checkpoint turned into a consolidated one in one process
(the tensors, the named optimizer state, meta.json's record), what it refuses, and the command
line's exit codes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sharded_exp.checkpoint.export import export, main
from sharded_exp.checkpoint.manager import CheckpointManager
from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.checkpoint.state import local_optimizer_state, named_param_groups, restore
from sharded_exp.checkpoint.storage import CheckpointError, read_meta

CPU = torch.device("cpu")
JOB = {"strategy": "fsdp", "precision": "32", "optimizer": "adam", "model": {"name": "tiny"}}


@pytest.fixture
def dcp_checkpoint(gloo_group, make_strategy, tmp_path):
    """(path, strategy): a dcp checkpoint at step 2 of a tiny strategy after two steps."""
    strategy = make_strategy(seed=1, steps=2)
    plan = CheckpointPlan(str(tmp_path / "ckpt"), "dcp", 1, 0, False, "refuse", None, 0)
    path = CheckpointManager.create(plan, JOB).save(strategy, 2, CPU)
    return path, strategy


def test_export_writes_a_consolidated_checkpoint_of_the_same_tensors(dcp_checkpoint, tmp_path):
    src, strategy = dcp_checkpoint
    dst = str(tmp_path / "out" / "step_00000002")
    export(src, dst)
    meta = read_meta(dst)  # complete and valid as a consolidated checkpoint
    assert meta["checkpoint_format"] == "consolidated"
    assert meta["exported_from"] == os.path.abspath(src)
    assert meta["step"] == 2 and meta["strategy"] == "fsdp"
    model = torch.load(os.path.join(dst, "model.pt"), weights_only=True)
    for k, v in strategy.module.state_dict().items():
        assert torch.equal(model[k], v)
    optim = torch.load(os.path.join(dst, "optim.pt"), weights_only=True)
    want = local_optimizer_state(strategy)
    assert set(optim["state"]) == set(want)
    for name in want:
        assert torch.equal(optim["state"][name]["exp_avg"], want[name]["exp_avg"])
    assert optim["param_groups"] == named_param_groups(strategy)


def test_an_exported_checkpoint_resumes_like_the_original(dcp_checkpoint, make_strategy, tmp_path):
    src, strategy = dcp_checkpoint
    dst = str(tmp_path / "exported")
    export(src, dst)
    target = make_strategy(seed=3, steps=0)
    restore(target, dst, CPU)
    for k, v in strategy.module.state_dict().items():
        assert torch.equal(target.module.state_dict()[k], v)


def test_export_leaves_no_temporary_directory(dcp_checkpoint, tmp_path):
    src, _ = dcp_checkpoint
    export(src, str(tmp_path / "out" / "exported"))
    assert os.listdir(tmp_path / "out") == ["exported"]


def test_export_refuses_a_consolidated_checkpoint(tmp_path, write_checkpoint):
    src = write_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointError, match="is consolidated already; nothing to export"):
        export(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_refuses_an_existing_destination(dcp_checkpoint, tmp_path):
    src, _ = dcp_checkpoint
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="exists; choose a new directory"):
        export(src, str(tmp_path / "taken"))
    assert os.listdir(tmp_path / "taken") == []


def test_main_exports_and_exits_0(dcp_checkpoint, tmp_path, capsys):
    src, _ = dcp_checkpoint
    dst = str(tmp_path / "cli")
    assert main(["export", src, dst]) == 0
    assert f"exported {src} -> {dst} (consolidated)" in capsys.readouterr().out
    with open(os.path.join(dst, "meta.json")) as f:
        assert json.load(f)["checkpoint_format"] == "consolidated"


@pytest.mark.parametrize("argv", [[], ["export", "a"], ["import", "a", "b"], ["export", "a", "b", "c"]])
def test_main_prints_the_usage_and_exits_2_on_wrong_arguments(argv, capsys):
    assert main(argv) == 2
    assert "usage: python -m sharded_exp.checkpoint export SRC DST" in capsys.readouterr().err


def test_main_names_a_bad_checkpoint_and_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "error: checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_main_reports_an_unwritable_destination_and_exits_1(dcp_checkpoint, tmp_path, capsys):
    src, _ = dcp_checkpoint
    (tmp_path / "a_file").write_text("x")
    assert main(["export", src, str(tmp_path / "a_file" / "out")]) == 1
    assert "nothing was written" in capsys.readouterr().err
