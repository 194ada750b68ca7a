"""sharded_exp.output.workspace's pure parts: a sweep's W&B group name, the metric keys each
section plots (per rank up to 8 ranks, the band beyond), the sweep's logger config, and
the offline specification file (the W&B workspace object itself stubbed)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from sharded_exp.output import workspace as ws


def test_a_group_is_the_directory_name_and_a_hash_of_its_absolute_path(tmp_path):
    a, b = tmp_path / "a" / "sweep", tmp_path / "b" / "sweep"
    expected = "sweep-" + hashlib.sha1(str(a).encode()).hexdigest()[:6]
    assert ws.wandb_group(a) == expected == ws.wandb_group(str(a))
    assert ws.wandb_group(b) != ws.wandb_group(a)


def test_a_relative_directory_is_grouped_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ws.wandb_group("sweep") == ws.wandb_group(os.path.join(str(tmp_path), "sweep"))


def test_up_to_eight_ranks_each_rank_has_its_panels():
    keys = ws.panel_keys(ws.PER_RANK_UP_TO, ["ddp", "fsdp"])
    assert keys["peak per rank"] == [f"memory/per_rank/{r}/peak_allocated_mib" for r in range(8)]
    assert len(keys["model states per rank"]) == 8 * 3
    assert keys["model states per rank"][:3] == [
        f"memory/per_rank/0/model_states_mib/{p}" for p in ("params", "grads", "optimizer")
    ]
    assert keys["memory over time per rank"][-1] == "memory/per_rank/7/allocated_mib"
    assert keys["memory vs world size"] == [
        "by_strategy/ddp/peak_allocated_mib_max",
        "by_strategy/fsdp/peak_allocated_mib_max",
    ]
    assert keys["throughput vs world size"] == ["by_strategy/ddp/samples_per_s", "by_strategy/fsdp/samples_per_s"]


def test_beyond_eight_ranks_the_band_over_ranks_replaces_them():
    keys = ws.panel_keys(ws.PER_RANK_UP_TO + 1, ["fsdp"])
    assert keys["peak per rank"] == ["memory/peak_allocated_mib_min", "memory/peak_allocated_mib_median",
                                     "memory/peak_allocated_mib_max"]  # fmt: skip
    assert keys["model states per rank"] == ["memory/model_states_mib_max"]
    assert keys["memory over time per rank"] == []
    assert keys["memory over time across ranks"] == ["memory/allocated_mib_min", "memory/allocated_mib_median",
                                                     "memory/allocated_mib_max"]  # fmt: skip


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
    assert built == [("ENTITY", "sharded_exp", group, 4, ["ddp", "fsdp"], f"sharded_exp sweep {group}")]
    spec = json.loads((tmp_path / ws.SPEC_FILE).read_text())
    assert spec["entity"] is None and spec["project"] == "sharded_exp" and spec["group"] == group
    assert spec["panel_keys"] == ws.panel_keys(4, ["ddp", "fsdp"]) and spec["spec"] == {"sections": []}
    assert told.startswith(f"workspace specification: {tmp_path / ws.SPEC_FILE}\n")
    assert told.endswith("--wandb-workspace --online --entity YOUR_ENTITY")
    # the logger's own group, project and entity win
    points[0]["config"]["logger"].update(group="G", project="P", entity="E")
    told = ws.write_or_save(tmp_path, points, None, online=False)
    assert built[-1][:3] == ("E", "P", "G") and not told.endswith("YOUR_ENTITY")
