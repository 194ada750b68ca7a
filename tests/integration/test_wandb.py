"""W&B: the real offline run file is read back and must equal result.json."""

from __future__ import annotations

import time

import pytest

from sharded_exp.report.workspace import wandb_group
from tests.helpers.jobs import ROOT, TINY, read_result, run_cli
from tests.helpers.wandb_file import find_runs, read_run

WANDB_TINY = [o for o in TINY if o != "logger=none"] + ["logger=wandb"]


@pytest.fixture(scope="module")
def offline_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb_job") / "run_dir"
    proc = run_cli(["strategy=oss", *WANDB_TINY, f"hydra.run.dir={out}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = find_runs(out)
    assert len(runs) == 1, runs  # one W&B run per job, from rank 0 only
    return read_result(out), read_run(runs[0]), out


def test_run_identity_and_config(offline_job):
    result, run, out = offline_job
    assert run["group"] == wandb_group(out) and run["group"].startswith(out.name + "-")  # the run directory
    assert run["job_type"] == "oss"
    assert "strategy=oss" in run["name"] and "trainer.steps=6" in run["name"]
    assert run["config"]["strategy"]["name"] == "oss"
    assert run["config"]["trainer"] == result["config"]["trainer"]
    assert run["exit_code"] == 0


def test_summary_equals_result_json(offline_job):
    """Every W&B summary key is a result.json path (``/`` between keys) holding the same value,
    or a copy keyed by strategy for a panel, or the summary W&B keeps of a history series."""
    from sharded_exp.sweep import result_at

    result, run, _ = offline_job
    s = {k: v for k, v in run["summary"].items() if not k.startswith("_")}
    series = {k for h in run["history"] for k in h if not k.startswith("_")}
    for key, value in s.items():
        expected = result_at(result, key)
        if key.startswith("by_strategy/"):
            _, strategy, figure = key.split("/")
            section = "throughput" if figure == "samples_per_s" else "memory"
            assert strategy == result["strategy"] and value == result[section][figure], key
        elif expected is None and key in series:  # W&B's summary of a series result.json has no figure for
            assert key in ("loss", "accuracy", "perplexity") or key.startswith("eval/"), key
        else:
            assert expected == value, key
    mem = result["memory"]
    assert s["memory/peak_allocated_mib_max"] == mem["peak_allocated_mib_max"]
    assert s["memory/predicted_model_states_mib_max"] == mem["predicted_model_states_mib_max"]
    for index, entry in enumerate(mem["per_rank"]):
        assert s[f"memory/per_rank/{index}/peak_allocated_mib"] == entry["peak_allocated_mib"]
        assert s[f"memory/per_rank/{index}/model_states_mib/optimizer"] == entry["model_states_mib"]["optimizer"]
    assert s["param_digest/l2"] == result["param_digest"]["l2"] and s["final_loss"] == result["final_loss"]
    # metric summaries: min for loss; throughput is result.json's figure under the same name
    # as its per-step points (the median of them), and each timed step is one point
    losses = [h["loss"] for h in run["history"] if "loss" in h]
    assert s["loss"] == {"min": min(losses)}
    rates = [h["throughput/samples_per_s"] for h in run["history"] if "throughput/samples_per_s" in h]
    assert len(rates) == result["throughput"]["timed_steps"]
    assert s["throughput/step_time_s_median"] == result["throughput"]["step_time_s_median"]
    assert not any(k.startswith(("train/", "mem/")) for k in s | {k: 0 for k in series})  # the old second names


def test_history_equals_result_json(offline_job):
    result, run, _ = offline_job
    for name in ("loss", "accuracy"):
        logged = {h["_step"]: h[name] for h in run["history"] if name in h}
        assert logged == {h["step"]: h[name] for h in result["history"]}, name
    timed = [h for h in run["history"] if "throughput/step_time_s" in h]
    assert len(timed) == result["throughput"]["timed_steps"]


def test_one_name_per_figure_in_result_json_wandb_and_the_report(offline_job):
    """A real run's four outputs: each report.csv column the report does not derive is one
    key of result.json (found at exactly one path, with the value the row holds), the same
    name heads report.md's table, and W&B's summary holds it at that path; the objective
    paths are those names."""
    import csv

    from sharded_exp.report.publish import write_report
    from sharded_exp.report.rows import COLUMNS
    from sharded_exp.sweep import OBJECTIVES, result_at

    result, run, out = offline_job
    write_report(out)  # the report of a directory holding this one run
    (row,) = list(csv.DictReader((out / "report.csv").open()))
    md = (out / "report.md").read_text()
    summary = run["summary"]
    series = {k for h in run["history"] for k in h}
    derived = {  # the report's own figures: comparisons with the baseline, the config's budget, texts
        "peak_saving_pct", "peak_mean_saving_pct", "states_saving_pct", "speed_vs_baseline",
        "speed_vs_baseline_ci95_low", "speed_vs_baseline_ci95_high", "speed_within_noise", "parity_vs_baseline",
        "baseline", "memory_limit_mib", "device", "oom_breakdown",
    }  # fmt: skip

    # Where the report reads its figures: the top level, throughput, memory (its own figures,
    # not the per-rank or breakdown records), the device and the final evaluation.
    found: dict[str, list] = {}
    candidates = [(k, k, v) for k, v in result.items() if not isinstance(v, (dict, list))]
    for section in ("throughput", "memory", "device"):
        candidates += [(k, f"{section}/{k}", v) for k, v in (result.get(section) or {}).items()
                       if not isinstance(v, (dict, list))]  # fmt: skip
    candidates += [(k, f"eval/final/{k}", v) for k, v in ((result.get("eval") or {}).get("final") or {}).items()]
    for name, path, value in candidates:
        found.setdefault(name, []).append((path, value))
    checked = 0
    for column in COLUMNS:
        assert column in row, column
        if column in derived or column.startswith("eval/") and column not in found:
            continue
        assert len(found.get(column, [])) == 1, (column, found.get(column))
        ((path, value),) = found[column]
        cell = row[column]
        if isinstance(value, float):
            assert float(cell) == pytest.approx(value, rel=1e-9), column
        else:
            assert cell == ("" if value is None else str(value)), column
        assert f"| {column} |" in md or column not in md.split("\n## ")[0], column  # a header, not a second name
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # W&B: the same name, at the same path; the final evaluation is the last point of its series
            key = column if path.startswith("eval/final/") else path
            assert summary[key] == value, key
        checked += 1
    assert checked >= 15
    for objective in OBJECTIVES:  # objective=... names a figure by the same path
        value = result_at(result, objective)
        if value is not None and objective not in series and not objective.startswith("eval/"):
            assert summary[objective] == value, objective


@pytest.mark.slow
def test_logger_none_writes_no_wandb_files(tmp_path):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_unreachable_server_does_not_fail_training(tmp_path):
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    t0 = time.monotonic()
    proc = run_cli(
        [*WANDB_TINY, "logger.mode=online", "logger.init_timeout_s=5", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_result(tmp_path)["status"] == "ok"
    assert "W&B could not start" in proc.stderr
    assert elapsed < 120


def test_memory_over_time_for_every_rank_at_every_interval(offline_job):
    """Each rank's memory rides in the interval's asynchronous reduction to rank 0 and is
    logged as memory/per_rank/{r}/...: the same values as result.json's history."""
    result, run, _ = offline_job
    intervals = [h["step"] for h in result["history"]]
    assert intervals == list(range(2, result["steps"] + 1, 2))
    for r in range(result["world_size"]):
        for name in ("allocated_mib", "peak_allocated_mib"):
            key = f"memory/per_rank/{r}/{name}"
            logged = {h["_step"]: h[key] for h in run["history"] if key in h and "loss" in h}
            assert logged == {h["step"]: h[key] for h in result["history"]}, key
            assert sorted(logged) == intervals
        allocated = [h[f"memory/per_rank/{r}/allocated_mib"] for h in result["history"]]
        peaks = [h[f"memory/per_rank/{r}/peak_allocated_mib"] for h in result["history"]]
        states = sum(result["memory"]["per_rank"][r]["model_states_mib"].values())
        # between steps a rank holds at least its model states; the peak so far only grows
        assert all(a >= 0.99 * states for a in allocated) and peaks == sorted(peaks)
        assert peaks[-1] == result["memory"]["per_rank"][r]["peak_allocated_mib"]


def test_runs_are_tagged_for_grouping(offline_job):
    result, run, _ = offline_job
    assert run["tags"] == [f"strategy:{result['strategy']}", f"precision:{result['precision']}",
                           f"model:{result['model']}", f"world_size:{result['world_size']}"]  # fmt: skip
    assert run["config"]["trainer"]["world_size"] == result["world_size"] == run["summary"]["world_size"]


@pytest.mark.slow
def test_sweep_report_run_and_saved_workspace(tmp_path):
    """A 2-point sweep with W&B: the report run holds W&B tables and W&B's own charts; the
    workspace view (offline: its specification) names only keys the sweep's runs logged,
    groups by the config and is filtered to the sweep's group."""
    import json

    from sharded_exp.report.workspace import CONFIG_AXES

    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "strategy=ddp,zero1", *WANDB_TINY, f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [read_run(f) for f in sorted(sweep.rglob("run-*.wandb"))]
    points = [r for r in runs if r["job_type"] != "report"]
    (report,) = [r for r in runs if r["job_type"] == "report"]
    logged = report["history"][0]
    assert logged["report/table/nrows"] == 2 and logged["report/per_rank/nrows"] == 4  # 2 points x 2 ranks
    for chart in ("peak_per_rank", "model_states_per_rank", "predicted_vs_measured", "samples_per_s"):
        assert f"_wandb/visualize/report/{chart}" in report["config"], chart  # a W&B chart, not an image
        assert logged[f"report/{chart}_table/_type"] == "table-file"
    assert logged["report/memory/_type"] == "image-file"  # the PNGs stay

    proc = run_cli([str(sweep), "--wandb-workspace"], cwd=ROOT, module="sharded_exp.report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb sync" in proc.stdout and "--wandb-workspace --online" in proc.stdout
    spec = json.loads((sweep / "wandb_workspace.json").read_text())
    assert spec["group"] == wandb_group(sweep) == points[0]["group"] == points[1]["group"]
    for run in points:
        present = set(run["summary"]) | {k for h in run["history"] for k in h}
        own = run["config"]["strategy"]["name"]
        for section, keys in spec["panel_keys"].items():
            # by_strategy/<name>/...: each strategy's runs carry only their own panel's key
            wanted = [k for k in keys if not k.startswith("by_strategy/") or k.startswith(f"by_strategy/{own}/")]
            missing = [k for k in wanted if k not in present]
            assert not missing, (section, missing)
        assert run["summary"][f"by_strategy/{own}/samples_per_s"] == run["summary"]["throughput/samples_per_s"]
        flat = {k.replace("/", "."): v for k, v in run["config"].items()}
        assert all(any(f.startswith(axis.split(".")[0]) for f in flat) for axis in CONFIG_AXES)
        assert own in ("ddp", "zero1")
    text = json.dumps(spec["spec"])
    assert f'{{"key": {{"section": "run", "name": "group"}}, "op": "=", "value": "{wandb_group(sweep)}"' in text
    # one group per point: strategy, world size and precision together, no max over the others
    assert '"grouping": [{"section": "config", "name": "strategy.value.name"}, ' in text
    assert '{"section": "config", "name": "trainer.value.world_size"}' in text
    assert '{"section": "config", "name": "precision.value.name"}' in text
    assert '"max"' not in text
    for keys in spec["panel_keys"].values():
        assert all(k in text for k in keys if k != "world_size")


def test_workspace_stays_readable_at_64_ranks_and_groups_are_per_directory(tmp_path):
    """At 64 ranks the view draws min / median / max bands over ranks, not 64 lines or bars;
    two sweep directories with one name get two W&B groups."""
    from sharded_exp.report.workspace import build, panel_keys

    keys = panel_keys(64, ["ddp", "fsdp"])
    assert keys["peak per rank"] == [f"memory/peak_allocated_mib_{b}" for b in ("min", "median", "max")]
    assert keys["memory over time per rank"] == []
    assert not any("per_rank/" in k for ks in keys.values() for k in ks)
    view = build("entity", "project", "g", 64, ["ddp", "fsdp"], "view")
    panels = [p for section in view.sections for p in section.panels]
    drawn = [getattr(p, "metrics", None) or getattr(p, "y", None) or [] for p in panels]
    assert len(panels) <= 12 and all(isinstance(d, str) or len(d) <= 3 for d in drawn), drawn
    titles = [p.title for p in panels]
    assert "ddp: peak per rank (MiB) vs world size" in titles and "fsdp: samples/s vs world size" in titles
    assert len(panel_keys(2, ["ddp"])["memory over time per rank"]) == 2  # small sweeps keep their per-rank lines

    a, b = tmp_path / "a" / "sweep", tmp_path / "b" / "sweep"
    assert wandb_group(a) != wandb_group(b) and wandb_group(a) == wandb_group(str(a))
    assert wandb_group(a).startswith("sweep-")
