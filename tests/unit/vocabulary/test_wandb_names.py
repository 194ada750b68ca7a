"""sharded_exp.vocabulary.wandb_names: every W&B name made in one place. A run's group and the
report run's id (two hashes of a path, kept as they were), names and tags; the metric keys (per
rank, the band over ranks, by strategy, the report's); the summary of a result; the keys each
workspace section plots; and that no other module spells a metric key itself."""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

import pytest

from sharded_exp.vocabulary import wandb_names as names

PACKAGE = Path(names.__file__).resolve().parents[1]


# ------------------------------------------------------------------------ runs
def test_a_group_is_the_directory_name_and_a_hash_of_its_absolute_path(tmp_path):
    a, b = tmp_path / "a" / "sweep", tmp_path / "b" / "sweep"
    expected = "sweep-" + hashlib.sha1(str(a).encode()).hexdigest()[:6]
    assert names.wandb_group(a) == expected == names.wandb_group(str(a))
    assert names.wandb_group(b) != names.wandb_group(a)


def test_a_relative_directory_is_grouped_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert names.wandb_group("sweep") == names.wandb_group(os.path.join(str(tmp_path), "sweep"))


def test_up_to_eight_ranks_each_rank_has_its_panels():
    keys = names.panel_keys(names.PER_RANK_UP_TO, ["ddp", "fsdp"])
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
    keys = names.panel_keys(names.PER_RANK_UP_TO + 1, ["fsdp"])
    assert keys["peak per rank"] == ["memory/peak_allocated_mib_min", "memory/peak_allocated_mib_median",
                                     "memory/peak_allocated_mib_max"]  # fmt: skip
    assert keys["model states per rank"] == ["memory/model_states_mib_max"]
    assert keys["memory over time per rank"] == []
    assert keys["memory over time across ranks"] == ["memory/allocated_mib_min", "memory/allocated_mib_median",
                                                     "memory/allocated_mib_max"]  # fmt: skip


def test_the_group_and_the_report_id_of_a_directory_are_pinned():
    """The names runs already have: a change here regroups every earlier run in W&B."""
    assert names.wandb_group("/sweeps/a/sweep") == "sweep-ba2859"
    assert names.report_run_id("/sweeps/a/sweep") == "report-ba28599dd122"


def test_the_report_id_follows_a_link_where_the_group_does_not(tmp_path):
    """The two hashes differ on a link (resolved path vs absolute one): each keeps the ids it gave."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert names.report_run_id(tmp_path / "link") == names.report_run_id(tmp_path / "real")
    assert names.wandb_group(tmp_path / "link") != names.wandb_group(tmp_path / "real")


def test_a_report_run_is_named_after_its_sweep_and_a_job_after_its_overrides():
    assert names.report_run_name("/x/outputs/compare") == "report compare"
    assert names.REPORT_JOB_TYPE == "report" and names.job_type("fsdp") == "fsdp"
    assert names.run_name("strategy=fsdp,trainer.world_size=4") == "strategy=fsdp,trainer.world_size=4"
    assert names.run_name("") == "defaults"


def test_tags_name_the_point_then_each_lever_that_is_on():
    assert names.run_tags("ddp", "32", "mlp", 2) == ["strategy:ddp", "precision:32", "model:mlp", "world_size:2"]
    tags = names.run_tags("fsdp", "bf16", "gpt", 4, activation_checkpointing="full", compile=True, replicate=2,
                          cpu_offload=True)  # fmt: skip
    assert tags[4:] == ["ac:full", "compile", "hsdp:2", "cpu_offload"]
    assert names.run_tags("fsdp", "bf16", "gpt", 4, replicate=1)[4:] == []


# ------------------------------------------------------------------------ metric keys
def test_metric_keys_are_result_json_paths():
    assert names.per_rank_key(3, "model_states_mib/params") == "memory/per_rank/3/model_states_mib/params"
    assert names.band_key("allocated_mib", "median") == "memory/allocated_mib_median"
    assert names.by_strategy_key("oss", "samples_per_s") == "by_strategy/oss/samples_per_s"
    assert names.report_key("table") == "report/table"
    assert (names.STEP_TIME_S, names.SAMPLES_PER_S, names.DATA_TIME_S) == (
        "throughput/step_time_s", "throughput/samples_per_s", "throughput/data_time_s")  # fmt: skip


def test_the_history_keeps_the_lowest_loss_and_no_summary_of_its_points():
    assert names.HISTORY_SUMMARIES == {"loss": "min", "throughput/*": "none", "memory/*": "none"}


def test_every_objective_is_a_summary_key_or_the_final_evaluation():
    assert len(set(names.OBJECTIVES)) == len(names.OBJECTIVES)
    assert all(o == "final_loss" or o.startswith(("throughput/", "memory/", "eval/final/")) for o in names.OBJECTIVES)


def test_summary_values_name_each_number_by_its_path():
    result = {
        "world_size": 2, "params": 10, "final_loss": 0.5, "status": "ok",
        "param_digest": {"l2": 3.0},
        "throughput": {"samples_per_s": 100.0, "step_time_s": [0.1, 0.2], "fused": True, "note": "x"},
        "device": {"threads_per_rank": 2, "type": "cpu"},
        "memory": {"peak_allocated_mib_max": 4.0, "peak_prediction": {"breakdown_mib": {"params": 1.0}},
                   "per_rank": [{"rank": 0, "peak_allocated_mib": 4.0, "model_states_mib": {"params": 1.0},
                                 "peak_breakdown_mib": {"Parameter": 1.0}}]},
    }  # fmt: skip
    values = names.summary_values(result, "fsdp")
    assert values == {
        "world_size": 2, "params": 10, "final_loss": 0.5,
        "param_digest/l2": 3.0, "throughput/samples_per_s": 100.0, "device/threads_per_rank": 2,
        "memory/peak_allocated_mib_max": 4.0, "memory/peak_prediction/breakdown_mib/params": 1.0,
        "memory/per_rank/0/peak_allocated_mib": 4.0, "memory/per_rank/0/model_states_mib/params": 1.0,
        "by_strategy/fsdp/samples_per_s": 100.0, "by_strategy/fsdp/peak_allocated_mib_max": 4.0,
    }  # fmt: skip


def test_summary_values_of_a_result_without_figures():
    assert names.summary_values({"status": "oom"}, "ddp") == {
        "by_strategy/ddp/samples_per_s": None,
        "by_strategy/ddp/peak_allocated_mib_max": None,
    }


@pytest.mark.parametrize(("values", "median"), [([3.0, 1.0, 2.0], 2.0), ([4.0, 1.0, 2.0, 3.0], 2.5), ([7.0], 7.0)])
def test_across_ranks_is_the_smallest_median_and_largest(values, median):
    assert names.across_ranks("peak", values) == {
        "memory/peak_min": min(values),
        "memory/peak_median": median,
        "memory/peak_max": max(values),
    }
    assert names.across_ranks("peak", []) == {}


# ------------------------------------------------------------------------ one place
PREFIXES = ("memory/", "throughput/", "by_strategy/", "report/")


def _spelled_keys(path: Path) -> list[str]:
    """String constants and f-strings in a module that open with a metric key's section."""
    tree = ast.parse(path.read_text())
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            text = node.value
        else:
            continue
        if text.startswith(PREFIXES):
            found.append(f"{node.lineno}: {text}")
    return found


def test_no_other_module_spells_a_metric_key():
    """A key spelled in two places drifts apart (a panel that plots nothing); they are made here."""
    vocabulary = PACKAGE / "vocabulary"
    offenders = {str(path.relative_to(PACKAGE)): _spelled_keys(path) for path in sorted(PACKAGE.rglob("*.py"))
                 if vocabulary not in path.parents}  # fmt: skip
    assert {path: hits for path, hits in offenders.items() if hits} == {}


def test_the_check_finds_a_spelled_key(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('KEY = "memory/peak"\nother = f"report/{name}"\nfine = "a memory/ note"\n')
    assert _spelled_keys(module) == ["1: memory/peak", "2: report/"]
