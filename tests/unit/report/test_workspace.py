"""sharded_exp.report.workspace's pure parts: the sweep's logger config and the offline
specification file (the W&B workspace object itself stubbed). The group's name and the keys each
section plots are tests/unit/vocabulary/test_wandb_names.py's."""

from __future__ import annotations

import json

import pytest

from sharded_exp.report import workspace as ws


def test_the_sweeps_logger_is_the_first_wandb_one():
    points = [{"config": {"logger": {"name": "none"}}}, {}, {"config": {"logger": {"name": "wandb", "project": "p"}}}]
    assert ws.sweep_logger(points) == {"name": "wandb", "project": "p"}
    assert ws.sweep_logger(points[:2]) is None


def test_a_sweep_without_wandb_has_no_workspace(tmp_path):
    with pytest.raises(ValueError, match="did not log to W&B"):
        ws.write_or_save(tmp_path, [{"config": {"logger": {"name": "none"}}}], None, online=False)


def test_offline_the_specification_is_written_with_the_commands_that_save_it(tmp_path, monkeypatch):
    built = []

    class Stub:
        def _to_model(self):
            return self

        def model_dump_json(self):
            return '{"sections": []}'

    monkeypatch.setattr(ws, "build", lambda *args: built.append(args) or Stub())
    points = [{"strategy": "fsdp", "world_size": 4, "config": {"logger": {"name": "wandb"}}},
              {"strategy": "ddp", "world_size": 2, "config": {"logger": {"name": "wandb"}}},
              {"status": "unreadable"}]  # fmt: skip
    told = ws.write_or_save(tmp_path, points, None, online=False)
    group = ws.wandb_group(tmp_path)
    assert built == [("ENTITY", "sharded_exp", group, 4, ["ddp", "fsdp"], f"sharded_exp sweep {group}", False)]
    spec = json.loads((tmp_path / ws.SPEC_FILE).read_text())
    assert spec["entity"] is None and spec["project"] == "sharded_exp" and spec["group"] == group
    assert spec["panel_keys"] == ws.panel_keys(4, ["ddp", "fsdp"]) and spec["spec"] == {"sections": []}
    assert told.startswith(f"workspace specification: {tmp_path / ws.SPEC_FILE}\n")
    assert told.endswith("--wandb-workspace --online --entity YOUR_ENTITY")
    # every point's run and the sweep's own report run (its tables and charts) are synced
    assert f"wandb sync {tmp_path}/*/wandb/offline-run-* {tmp_path}/wandb/offline-run-* && " in told
    # the logger's own group, project and entity win
    points[0]["config"]["logger"].update(group="G", project="P", entity="E")
    told = ws.write_or_save(tmp_path, points, None, online=False)
    assert built[-1][:3] == ("E", "P", "G") and not told.endswith("YOUR_ENTITY")
