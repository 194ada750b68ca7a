"""Sweeps: real multiruns in a subprocess, the report built from the points' result.json files."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sharded_exp.report.command import wrapped
from tests.helpers.jobs import ROOT, TINY, launch_job, run_cli
from tests.helpers.runs import cli
from tests.helpers.wandb_file import read_run


def _points(sweep):
    return [json.loads(p.read_text()) for p in sweep.rglob("result.json")]


@pytest.mark.slow
def test_sweep_ends_in_a_report(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        ["-m", "strategy=ddp,fsdp", "precision=32,bf16", *TINY, "report.device_profile=h100_sxm",
         f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = {(p["strategy"], p["precision"]): p for p in _points(sweep)}
    assert set(points) == {("ddp", "32"), ("ddp", "bf16"), ("fsdp", "32"), ("fsdp", "bf16")}
    assert not [p.name for p in sweep.iterdir() if "'" in p.name]  # precision=32, not precision='32' (22.20)
    for name in ("report.md", "report.csv", "memory.png", "throughput.png", "breakdown.png", "prediction.png"):
        assert (sweep / name).stat().st_size > 0, name

    rows = {(r["strategy"], r["precision"]): r for r in csv.DictReader(open(sweep / "report.csv"))}
    assert set(rows) == set(points)
    for precision in ("32", "bf16"):
        ddp = points[("ddp", precision)]
        fsdp = points[("fsdp", precision)]
        saving = 100 * (1 - fsdp["memory"]["model_states_mib_max"] / ddp["memory"]["model_states_mib_max"])
        assert float(rows[("fsdp", precision)]["states_saving_pct"]) == saving
        assert float(rows[("ddp", precision)]["states_saving_pct"]) == 0.0
        speed = fsdp["throughput"]["samples_per_s"] / ddp["throughput"]["samples_per_s"]
        assert float(rows[("fsdp", precision)]["speed_vs_baseline"]) == speed
    assert float(rows[("fsdp", "32")]["parity_vs_baseline"]) < 1e-6  # same training as DDP
    md = (sweep / "report.md").read_text()
    for part in md.split("## Charts"):  # the compact table first, every column at the end
        starts = [line.split(" | ")[0] for line in part.splitlines()]
        assert starts.count("| fsdp") == 2 and starts.count("| ddp") == 2

    # the terminal gets report.md's headline and where the report is; the headline says where
    # the speeds were measured and, for report.device_profile, the planned ratio beside each measured one
    headline = md.split("\n\n")[1]
    assert proc.stdout.endswith(f"{wrapped(headline)}\nreport: {sweep / 'report.md'} (4 points)\n"), proc.stdout[-2000:]
    assert re.search(r"Speeds measured on this machine's CPU, gloo, 2 ranks x \d+ threads?\.", headline), headline
    assert len(re.findall(r"its throughput, planned \d+\.\d\dx on h100_sxm[.;]", headline)) == 2, headline  # 32, bf16
    assert "Planned: each point's config priced by the planner's time model on h100_sxm at its world size." in headline

    # rebuilt from the files alone, the same report (the profile read from the points)
    before = (sweep / "report.csv").read_text()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "sharded_exp.report", str(sweep)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (sweep / "report.csv").read_text() == before
    assert (sweep / "report.md").read_text().split("\n\n")[1] == headline


@pytest.mark.slow
def test_oom_and_crashed_points_are_data(tmp_path):
    """OOM is a result; a crash fails the command, but only after every point ran."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        ["-m", *TINY, "trainer.memory_limit_mib=0.01,null", "trainer.steps=4,8", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        env={"SHARDED_EXP_FAULT": "rank=1,step=6,kind=raise"},  # only the 8-step points reach step 6
        timeout=400,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    status = {(p["config"]["trainer"]["memory_limit_mib"], p["steps"]): p["status"] for p in _points(sweep)}
    assert status == {(0.01, 4): "oom", (0.01, 8): "oom", (None, 4): "ok", (None, 8): "failed"}
    rows = list(csv.DictReader(open(sweep / "report.csv")))
    assert sorted(r["status"] for r in rows) == ["failed", "ok", "oom", "oom"]
    failed = next(r for r in rows if r["status"] == "failed")
    assert "rank 1: RuntimeError: injected fault" in failed["error"]


@pytest.mark.slow
def test_oom_alone_does_not_fail_the_sweep_and_wandb_gets_the_report(tmp_path):
    from sharded_exp.report.workspace import wandb_group

    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "logger=wandb", "trainer.memory_limit_mib=0.01,null", f"hydra.sweep.dir={sweep}"]
    proc = run_cli(args, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p["status"] for p in _points(sweep)) == ["ok", "oom"]
    assert (sweep / "report.md").exists()
    # one W&B group for the sweep: each point's run plus a "report" run with table and charts
    runs = [read_run(f) for f in sweep.rglob("run-*.wandb")]
    assert {r["group"] for r in runs} == {wandb_group(sweep)}
    report = [r for r in runs if r["job_type"] == "report"]
    assert len(report) == 1 and len(runs) == 3
    logged = report[0]["history"][0]
    assert logged["report/table/nrows"] == 2 and logged["report/memory/_type"] == "image-file"
    assert logged["report/samples_per_s_table/nrows"] == 1  # the OOM point gets no bar of 0 samples/s
    # Reporting again replaces the report run (22.16): one run, the same id.
    again = subprocess.run(
        [sys.executable, "-m", "sharded_exp.report", str(sweep)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    runs = [read_run(f) for f in sweep.rglob("run-*.wandb")]
    assert len([r for r in runs if r["job_type"] == "report"]) == 1 and len(runs) == 3


def test_report_rejects_a_missing_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.slow
def test_a_rerun_sweep_reports_one_row_per_point(tmp_path):
    """Running a sweep again in its directory archives each point's earlier result.json in
    attempts/<k>/; the report reads the current one only."""
    sweep = tmp_path / "sweep"
    args = ["-m", "strategy=ddp,zero1", *TINY, "trainer.steps=3", f"hydra.sweep.dir={sweep}"]
    for _ in range(2):
        proc = run_cli(args, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(sweep.rglob("attempts/1/result.json"))) == 2  # the first run's, archived
    rows = list(csv.DictReader(open(sweep / "report.csv")))
    assert sorted(r["strategy"] for r in rows) == ["ddp", "zero1"]


# ------------------------------------------------ baselines, stale points, lost reports
@pytest.mark.slow
def test_each_row_is_compared_with_the_ddp_point_of_its_own_settings(tmp_path):
    """Baselines are the DDP point whose swept overrides equal the row's (22.3); a reused
    sweep directory reports the points of the sweep that wrote it, and names the rest (22.10)."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "strategy=ddp,oss", "trainer.batch_size=8,16", "trainer.steps=4",
                    f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = {(p["strategy"], p["config"]["trainer"]["batch_size"]): p for p in _points(sweep)}
    rows = {(r["strategy"], int(r["trainer.batch_size"])): r for r in csv.DictReader(open(sweep / "report.csv"))}
    assert set(rows) == set(points) and len(rows) == 4
    for batch in (8, 16):
        ddp, oss, row = points[("ddp", batch)], points[("oss", batch)], rows[("oss", batch)]
        speed = oss["throughput"]["samples_per_s"] / ddp["throughput"]["samples_per_s"]
        assert float(row["speed_vs_baseline"]) == pytest.approx(speed)
        assert float(row["parity_vs_baseline"]) < 1e-6  # same batch, same data: parity holds
        assert row["baseline"] == f"ddp (point {os.path.basename(ddp['output_dir']).split('_')[0]})"
        assert rows[("ddp", batch)]["baseline"] == "itself"
    assert "| trainer.batch_size |" in (sweep / "report.md").read_text()

    # The same directory, a smaller sweep: its two points only, the other two named as stale.
    proc = run_cli(["-m", *TINY, "strategy=ddp,oss", "trainer.batch_size=8", "trainer.steps=4",
                    f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2 points)" in proc.stdout and "2 stale point(s) of an earlier sweep left out" in proc.stderr
    assert len(list(csv.DictReader(open(sweep / "report.csv")))) == 2
    assert "left here by an earlier sweep are not in this report" in (sweep / "report.md").read_text()


def test_a_point_without_a_ddp_twin_says_so():
    from sharded_exp.report.rows import build_rows

    def point(strategy, target, status="ok"):
        return {"status": status, "strategy": strategy, "world_size": 2, "precision": "32", "model": "custom",
                "output_dir": f"/s/{strategy}_{target}", "overrides": [f"strategy={strategy}", f"model._target_={target}"],
                "throughput": {"samples_per_s": 10.0 if strategy == "ddp" else 5.0}, "memory": {}}  # fmt: skip

    rows = {(r["strategy"], r["model._target_"]): r for r in build_rows([
        point("ddp", "a.A"), point("fsdp", "a.A"), point("fsdp", "b.B"), point("ddp", "c.C", "oom"), point("oss", "c.C")
    ])}  # fmt: skip
    assert rows[("fsdp", "a.A")]["baseline"] == "ddp (ddp_a.A)" and rows[("fsdp", "a.A")]["speed_vs_baseline"] == 0.5
    assert rows[("fsdp", "b.B")]["baseline"] == "none: no ddp point with the same settings"
    assert rows[("fsdp", "b.B")]["speed_vs_baseline"] is None
    assert rows[("oss", "c.C")]["baseline"] == "none: ddp (ddp_c.C) ended oom"


@pytest.mark.slow
def test_an_unexpected_pre_flight_failure_is_a_point_and_the_report_is_written(tmp_path, monkeypatch):
    """A point whose pre-flight raises something unforeseen (here: the planner's peak
    prediction, broken on purpose in that point's process) still ends with a result.json,
    and the sweep goes on to its report."""
    sweep = tmp_path / "sweep"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sharded_exp.launch.preflight as p\n"
        "real = p.predict\n"
        "def broken(strategy, optimizer, *args):\n"
        "    if optimizer.lr == 0.002:\n"
        "        raise KeyError('surprise')\n"
        "    return real(strategy, optimizer, *args)\n"
        "p.predict = broken\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    proc = run_cli(["-m", "optimizer.lr=0.001,0.002", *TINY, "trainer.steps=3", "trainer.progress_bar=true",
                    f"hydra.sweep.dir={sweep}"],
                   cwd=ROOT, env=env, timeout=300)  # fmt: skip
    points = {p["config"]["optimizer"]["lr"]: p for p in _points(sweep)}
    assert points[0.001]["status"] == "ok"
    assert points[0.002]["status"] == "failed" and "KeyError: 'surprise'" in points[0.002]["error"]
    assert "traceback" in points[0.002]
    assert (sweep / "report.md").exists() and "(2 points)" in proc.stdout
    assert proc.returncode == 1  # a failed point, said in the exit code
    # Each point keeps its own messages, in its own directory: its ranks' and its parent's
    ran = (Path(points[0.001]["output_dir"]) / "sharded_exp.log").read_text()
    failed = (Path(points[0.002]["output_dir"]) / "sharded_exp.log").read_text()
    assert "[rank 0][sharded_exp.train.components][INFO]" in ran and "finished: ok" in ran and "surprise" not in ran
    assert "[parent][sharded_exp][ERROR] error: KeyError: 'surprise'" in failed and "[rank 0]" not in failed


# ------------------------------------------------ sweep point names of any length
def test_a_point_name_is_cut_to_a_safe_length_with_a_hash():
    from sharded_exp.compose import MAX_DIRNAME, point_dirname

    assert point_dirname("precision='32',strategy=ddp") == "precision=32,strategy=ddp"
    long = ",".join(f"logger.tags=[tag{i}]" for i in range(40))
    a, b = point_dirname(long), point_dirname(long + ",x=1")
    assert len(a.encode()) <= MAX_DIRNAME and a != b and a.startswith("logger.tags=[tag0]")


@pytest.mark.slow
def test_a_sweep_with_long_overrides_runs_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    name = "x" * 300  # one override longer than a file name may be
    proc = run_cli(["-m", *TINY, "trainer.steps=2", "strategy=ddp,zero1", f"logger.run_name={name}",
                    f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_points(sweep)) == 2 and (sweep / "report.md").exists()
    assert all(len(p.name) <= 255 for p in sweep.iterdir())


# ------------------------------------------------ a report that cannot mislead
def _lines(ax):
    """Every drawn line's (label, x, y), the limit lines among them."""
    return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def _texts(ax):
    """Every annotation and text of a chart with its position in data coordinates."""
    return [(t.get_text(), t.xy if hasattr(t, "xy") else t.get_position()) for t in ax.texts]


def _oom_point(real: dict, world_size: int, limit: float) -> dict:
    """A point that ran out of memory, in the shape such a point's result.json has: the
    pre-flight prediction only (results.predicted_section), no measured figure."""
    memory = real["memory"]
    keep = ("predicted_model_states_mib_max", "predicted_transient_params_mib", "predicted_peak_mib_max",
            "peak_prediction", "memory_limit_applies_to")  # fmt: skip
    per_rank = [
        {k: e[k] for k in ("rank", "predicted_model_states_mib", "predicted_peak_mib")} for e in memory["per_rank"]
    ]
    config = {**real["config"], "trainer": {**real["config"]["trainer"], "memory_limit_mib": limit}}
    return {**{k: real[k] for k in ("strategy", "precision", "model", "optimizer", "params", "steps", "accelerator")},
            "status": "oom", "world_size": world_size, "config": config, "error": "rank 0: torch.OutOfMemoryError: ...",
            "memory": {"per_rank": per_rank, **{k: memory[k] for k in keep}}}  # fmt: skip


def _write_sweep(sweep, points):
    for i, point in enumerate(points):
        d = sweep / f"{i}_strategy={point['strategy']},trainer.world_size={point['world_size']}"
        d.mkdir(parents=True)
        point = {**point, "output_dir": str(d),
                 "overrides": [f"strategy={point['strategy']}", f"trainer.world_size={point['world_size']}"]}  # fmt: skip
        (d / "result.json").write_text(json.dumps(point))


def test_report_marks_what_did_not_finish_and_compares_with_the_least_sharded_that_fits(shared_runs, tmp_path):
    """Real result.json files of ddp and fsdp (shared with test_models and test_cli), laid out as a
    sweep whose 4-rank DDP ran out of memory and whose zero1 diverged: such points are
    labelled markers, never zeros; the 4-rank rows are compared with the least
    sharded point that fits; the headline says so in numbers computed from the files."""
    from sharded_exp.output import charts
    from sharded_exp.report import figures
    from sharded_exp.report.figures import CHARTS
    from sharded_exp.report.publish import write_report
    from sharded_exp.report.rows import build_rows, swept_of
    from sharded_exp.report.sweep_points import load_points
    from tests.helpers.overrides import SCALAR

    _, ddp = shared_runs("strategy=ddp", *SCALAR)
    _, fsdp = shared_runs("strategy=fsdp", *SCALAR)
    assert ddp["status"] == fsdp["status"] == "ok"
    ddp_peak, fsdp_peak = ddp["memory"]["peak_allocated_mib_max"], fsdp["memory"]["peak_allocated_mib_max"]
    limit = round((ddp_peak + fsdp_peak) / 2, 4)  # DDP does not fit, FSDP does
    oss = {**ddp, "strategy": "oss", "world_size": 4}  # stands for a point that fits at 4 ranks
    zero1 = {**ddp, "strategy": "zero1", "world_size": 4, "status": "diverged", "first_nonfinite_step": 2}
    sweep = tmp_path / "sweep"
    _write_sweep(sweep, [ddp, fsdp, _oom_point(ddp, 4, limit), oss, {**fsdp, "world_size": 4}, zero1])
    write_report(sweep)
    rows = {(r["strategy"], r["world_size"]): r for r in build_rows(load_points(sweep))}

    # Baselines: DDP where it ran; at 4 ranks, where it ran out of memory, oss (the least sharded that fits).
    assert rows[("fsdp", 2)]["baseline"] == "ddp (point 0)"
    assert rows[("fsdp", 4)]["baseline"] == "oss (point 3): ddp (point 2) ended oom"
    assert rows[("oss", 4)]["baseline"] == "itself: ddp (point 2) ended oom"
    saving = 100 * (1 - fsdp_peak / ddp_peak)
    assert rows[("fsdp", 4)]["peak_saving_pct"] == pytest.approx(saving)
    assert rows[("fsdp", 2)]["peak_saving_pct"] == pytest.approx(saving)
    assert rows[("zero1", 4)]["peak_saving_pct"] is None and rows[("ddp", 4)]["speed_vs_baseline"] is None
    csv_rows = list(csv.DictReader(open(sweep / "report.csv")))
    assert {"baseline", "mfu_pct", "peak_saving_pct", "speed_vs_baseline", "memory_limit_mib"} <= set(csv_rows[0])
    assert float(next(r for r in csv_rows if r["status"] == "ok")["mfu_pct"]) == pytest.approx(
        ddp["throughput"]["mfu_pct"]
    )

    # The headline first, in numbers from the files; the compact table; every chart embedded.
    md = (sweep / "report.md").read_text()
    head = md.split("\n\n")[1]
    speed = fsdp["throughput"]["samples_per_s"] / ddp["throughput"]["samples_per_s"]
    assert f"At 2 ranks, fsdp peaks {saving:.0f}% below ddp" in head
    # these points time fewer than 6 steps: a ratio without an interval, and the headline says so
    assert f"at {speed:.2f}x (no interval: too few timed steps) its throughput" in head
    assert f"At 4 ranks, fsdp peaks {saving:.0f}% below oss ({charts.num(fsdp_peak)} vs {charts.num(ddp_peak)} MiB), " \
           "the least sharded strategy that fits" in head  # fmt: skip
    assert f"ddp does not fit in {limit:g} MiB at 4 ranks" in head and "zero1 diverged at 4 ranks" in head
    assert (
        "| strategy | world_size | precision | peak_allocated_mib_max | peak_allocated_mib_mean | "
        "predicted_peak_mib_max | peak_saving_pct |"
    ) in md
    for name in CHARTS:
        assert f"]({name})" in md and (sweep / name).stat().st_size > 0

    table = list(rows.values())
    swept = swept_of(table)
    # (1) memory: the OOM point (no measured figure: a pre-flight record) is a labelled cross
    # at the limit it crossed, the diverged one at its measured peak; the limit is a line;
    # nothing is drawn at zero. (Labels are moved apart: the crosses hold the positions.)
    ax = figures.memory_chart(table, swept).axes[0]
    texts = _texts(ax)
    crosses = sorted(y for line in ax.get_lines() if line.get_marker() == "X" for y in line.get_ydata())
    assert crosses == sorted([limit, ddp_peak])  # it ran: the diverged one at its measured peak
    assert {"OOM", "diverged"} <= {t for t, _ in texts}
    assert any(y == [limit, limit] for _, _, y in _lines(ax))
    assert all(v > 0 for _, _, ys in _lines(ax) for v in ys)
    assert charts.num(fsdp_peak) in [t for t, _ in texts]  # each measured point labelled
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2 ranks", "4 ranks"]
    # (2) throughput: the points without one are named, not drawn at zero.
    ax = figures.throughput_chart(table, swept).axes[0]
    (box,) = [t for t, _ in _texts(ax) if t.startswith("no throughput:")]
    assert box.splitlines()[1:] == ["ddp at 4 ranks: OOM", "zero1 at 4 ranks: diverged"]
    assert all(v > 0 for _, _, ys in _lines(ax) for v in ys)
    # (3) breakdown: measured parts add up to the measured peak, predicted to the prediction.
    for real in (ddp, fsdp):
        row = rows[(real["strategy"], 2)]
        assert sum(figures.measured_parts(row).values()) == pytest.approx(real["memory"]["peak_allocated_mib_max"])
        pred = real["memory"]["peak_prediction"]
        rank_peak = real["memory"]["per_rank"][pred["rank"]]["predicted_peak_mib"]
        assert sum(figures.predicted_parts(row).values()) == pytest.approx(rank_peak)
    assert figures.measured_parts(rows[("ddp", 4)]) is None
    assert "OOM" in [t for t, _ in _texts(figures.breakdown_chart(table, swept).axes[0])]
    # (4) predicted vs measured: one dot per rank of each point that ran, the ±5% band.
    ax = figures.prediction_chart(table, swept).axes[0]
    dots = sum(len(c.get_offsets()) for c in ax.collections[1:])
    assert dots == sum(len(r["per_rank"]) for r in table if r["status"] == "ok")


def test_figures_read_with_two_decimals_and_plain_words():
    from sharded_exp.output.charts import num, ranks
    from sharded_exp.report.text import _ranks_list

    assert (num(3.66), num(2.94), num(0.08656), num(6184.26), num(None)) == ("3.66", "2.94", "0.0866", "6,184", "-")
    assert (ranks(1), ranks(2), _ranks_list([2, 1]), _ranks_list([1, 2, 4])) == (
        "1 rank", "2 ranks", "1 or 2 ranks", "1, 2 or 4 ranks")  # fmt: skip
    from sharded_exp.report.publish import _label  # W&B's report tables and bars

    assert (
        _label({"strategy": "ddp", "world_size": 1, "precision": "32", "model": "mlp"})
        == "ddp | 1 rank | precision 32 | mlp"
    )


@pytest.mark.slow
def test_the_oom_sweep_reports_what_fits(tmp_path):
    """The issue's sweep, ddp/oss/fsdp at 1 and 2 ranks under a budget between FSDP's and
    DDP's predicted peak (from the planner, which is every run's own prediction): DDP runs
    out of memory at both world sizes, FSDP fits at 2 ranks; report.md says so first, the
    OOM points are markers at the limit and the rows are compared with the least sharded
    point that fits."""
    from sharded_exp.output import charts
    from sharded_exp.report import figures
    from sharded_exp.report.rows import build_rows, swept_of
    from sharded_exp.report.sweep_points import load_points
    from tests.helpers.runs import plan_json

    model = [o for o in TINY if o.startswith("model.")]
    plan = plan_json(*model, "trainer.batch_size=8", "plan.world_sizes=[1,2]", "plan.strategies=[ddp,oss,fsdp]",
                     "plan.device=cpu")  # fmt: skip
    mib = {(r["strategy"], r["world_size"]): r["total_gib"] * 1024 for r in plan["rows"]}
    limit = round((mib[("ddp", 2)] + max(mib[("fsdp", 1)], mib[("fsdp", 2)])) / 2, 4)
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "strategy=ddp,oss,fsdp", "trainer.world_size=1,2", f"trainer.memory_limit_mib={limit}",
                    *TINY, f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]  # OOM is a result, not a failure
    points = {(p["strategy"], p["world_size"]): p for p in _points(sweep)}
    status = {k: p["status"] for k, p in points.items()}
    assert status[("ddp", 1)] == status[("ddp", 2)] == "oom" and status[("fsdp", 2)] == "ok", status

    head = (sweep / "report.md").read_text().split("\n\n")[1]
    both = [s for s in ("ddp", "oss", "fsdp") if status[(s, 1)] == status[(s, 2)] == "oom"]
    who = " and ".join(both)
    assert f"{who} {'does' if len(both) == 1 else 'do'} not fit in {limit:g} MiB at 1 or 2 ranks" in head, head
    base = "oss" if status[("oss", 2)] == "ok" else "fsdp"  # the least sharded that fits at 2 ranks
    if base == "oss":
        fsdp, oss = (points[(s, 2)]["memory"]["peak_allocated_mib_max"] for s in ("fsdp", "oss"))
        assert f"At 2 ranks, fsdp peaks {100 * (1 - fsdp / oss):.0f}% below oss" in head, head
    rows = build_rows(load_points(sweep))
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    ddp_point = os.path.basename(points[("ddp", 2)]["output_dir"]).split("_")[0]
    assert by[("fsdp", 2)]["baseline"].endswith(f": ddp (point {ddp_point}) ended oom")
    # fsdp alone fits at 2 ranks: nothing to compare it with (a baseline needs another point that fits)
    assert by[("fsdp", 2)]["baseline"].startswith("none: " if base == "fsdp" else "oss (point ")

    # Each OOM is a cross at its one number, what was live when it crossed its budget (above
    # it), labelled with it; the same number as its error says.
    ax = figures.memory_chart(rows, swept_of(rows)).axes[0]
    crosses = sorted(y for line in ax.get_lines() if line.get_marker() == "X" for y in line.get_ydata())
    at = sorted(r["oom_at_mib"] for r in rows if r["status"] == "oom")
    assert len(at) == list(status.values()).count("oom") and crosses == at and all(y > limit for y in at)
    assert {f"OOM {charts.num(y)}" for y in at} <= {t for t, _ in _texts(ax)}
    for r in (r for r in rows if r["status"] == "oom"):
        assert f"reached {r['oom_at_mib']:.2f} MiB" in r["error"]
    md = (sweep / "report.md").read_text()
    for name in ("memory.png", "throughput.png", "breakdown.png", "prediction.png"):
        assert f"]({name})" in md and (sweep / name).stat().st_size > 0


def test_a_sweep_with_no_usable_result_still_gets_its_report(tmp_path):
    """A sweep killed mid-run can leave only unreadable result.json files: the report says
    so, draws no chart and links none."""
    from sharded_exp.report.publish import write_report

    for name in ("0_strategy=ddp", "1_strategy=fsdp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text('{"status": "ok", "strat')  # cut off mid-write
    rows = write_report(tmp_path)
    assert len(rows) == 2
    text = (tmp_path / "report.md").read_text()
    assert "No chart: no point has a usable result." in text and "](" not in text
    assert "usable result.json" in text
    assert not list(tmp_path.glob("*.png"))


def test_a_cpu_oom_point_shows_what_was_live_when_it_crossed_its_budget():
    """The breakdown chart draws a CPU OOM point's measured bar from its oom_breakdown, marked OOM."""
    from sharded_exp.report import figures
    from sharded_exp.report.rows import point_row

    oom = {"strategy": "ddp", "world_size": 2, "precision": "32", "model": "mlp", "status": "oom",
           "memory": {"per_rank": [], "peak_prediction": {"breakdown_mib": {"params": 1.0, "activations": 3.0}},
                      "oom_breakdown": {"rank": 1, "step": 0, "phase": "forward", "limit_mib": 3.0, "tracked_mib": 3.5,
                                        "by_category_mib": {"Parameter": 1.0, "Activation": 2.5},
                                        "top_modules_mib": {"body.0": 2.0}}}}  # fmt: skip
    row = point_row(oom)
    assert figures.measured_parts(row)["activations"] == 2.5 and figures.measured_parts(row)["parameters"] == 1.0
    assert (
        row["oom_breakdown"]
        == "rank 1 step 0 (forward): 3.50 MiB over 3.0; Activation 2.50, Parameter 1.00; top modules body.0 2.00"
    )
    texts = [t for t, _ in _texts(figures.breakdown_chart([row], []).axes[0])]
    assert "3.50 OOM" in texts and "4.00" in texts  # measured at the crossing, beside the predicted peak


def test_the_report_shows_the_average_over_ranks_beside_the_largest():
    """The seed study reported the average over ranks of each rank's peak; what must fit is
    the largest. result.json carries both, and the report's tables and the end-of-run table
    show both (an older result.json without the average gets it from its ranks)."""
    from sharded_exp.job.result import Result
    from sharded_exp.output.results import memory_section, summary_table
    from sharded_exp.report.rows import build_rows, columns
    from sharded_exp.report.text import compact, markdown

    def point(strategy: str, peaks: list[float], old: bool = False) -> dict:
        states = [{"params": 1.0, "grads": 1.0, "optimizer": 1.0} for _ in peaks]
        prediction = {"model_states_mib": states, "transient_params_mib": 0.0,
                      "peak": {"per_rank_mib": [p + 1 for p in peaks]}}  # fmt: skip
        per_rank = [
            {"rank": r, "peak_allocated_mib": p, "model_states_mib": dict(states[r])} for r, p in enumerate(peaks)
        ]
        memory = memory_section(prediction, per_rank, "torch_mem_tracker")
        if old:
            del memory["peak_allocated_mib_mean"], memory["predicted_peak_mib_mean"]
        return {"status": "ok", "strategy": strategy, "world_size": len(peaks), "precision": "32", "model": "m",
                "params": 10, "output_dir": f"/s/{strategy}", "memory": memory,
                "throughput": {"samples_per_s": 1.0, "step_time_s_median": 0.5}}  # fmt: skip

    ddp, sharded = point("ddp", [100.0, 100.0, 100.0, 100.0]), point("sharded_ddp", [90.0, 60.0, 60.0, 70.0])
    mem = sharded["memory"]
    assert (mem["peak_allocated_mib_max"], mem["peak_allocated_mib_mean"], mem["predicted_peak_mib_mean"]) == (
        90.0, 70.0, 71.0)  # fmt: skip
    rows = {r["strategy"]: r for r in build_rows([ddp, sharded])}
    assert rows["sharded_ddp"]["peak_allocated_mib_mean"] == 70.0
    assert rows["sharded_ddp"]["peak_saving_pct"] == pytest.approx(10.0)  # of the largest
    assert rows["sharded_ddp"]["peak_mean_saving_pct"] == pytest.approx(30.0)  # of the average
    old = {r["strategy"]: r for r in build_rows([ddp, point("sharded_ddp", [90.0, 60.0, 60.0, 70.0], old=True)])}
    assert old["sharded_ddp"]["peak_allocated_mib_mean"] == 70.0
    assert old["sharded_ddp"]["predicted_peak_mib_mean"] == 71.0
    table = list(rows.values())
    cols = columns(table)
    assert cols.index("peak_allocated_mib_mean") == cols.index("peak_allocated_mib_max") + 1
    assert "| peak_allocated_mib_max | peak_allocated_mib_mean |" in markdown(table)
    assert "| peak_allocated_mib_max | peak_allocated_mib_mean |" in compact(table) and "| 90.00 | 70.00 |" in compact(
        table
    )
    end = summary_table(Result.of({**sharded, "optimizer": "adam", "config": {}, "memory": mem})).splitlines()
    at = next(i for i, line in enumerate(end) if "peak_MiB  peak_mean_MiB" in line)  # the table's memory block
    assert "70.00" in end[at + 2]


# ------------------------------------------ bad points, empty and read-only directories
def test_a_bad_result_json_is_a_row_that_says_why(tmp_path):
    from sharded_exp.report.publish import write_report

    sweep = tmp_path / "sweep"
    good = launch_job(["trainer.steps=2"], sweep / "0_good")
    assert good["status"] == "ok"
    (sweep / "1_truncated").mkdir()
    (sweep / "1_truncated" / "result.json").write_text('{"status": "ok", "strat')
    (sweep / "2_running").mkdir()
    (sweep / "2_running" / "result.json").write_text('{"status": "running"}')
    rows = write_report(sweep)
    assert (sweep / "report.md").exists() and len(rows) == 3
    by_status = {r["status"]: r for r in rows}
    assert "1_truncated/result.json" in by_status["unreadable"]["error"]
    assert "still running or killed before it finished" in by_status["running"]["error"]
    assert by_status["ok"]["peak_allocated_mib_max"] > 0


def _hand_made(strategy: str, peak: float, **changes) -> dict:
    """A point's result.json as the schema has it, small: what a row needs and a few figures (no
    schema_version: the session's check of what the product wrote leaves it out)."""
    point = {"status": "ok", "strategy": strategy, "precision": "32", "model": "mlp",
             "optimizer": "adam", "world_size": 2, "params": 100, "steps": 4, "output_dir": "",
             "config": {"trainer": {"batch_size": 8, "memory_limit_mib": None}}, "final_loss": 1.0,
             "memory": {"peak_allocated_mib_max": peak, "predicted_peak_mib_max": peak + 1,
                        "per_rank": [{"rank": 0, "peak_allocated_mib": peak, "predicted_peak_mib": peak + 1}]},
             "throughput": {"samples_per_s": 100.0},
             "param_digest": {"sum": 1.0, "l2": 2.0}}  # fmt: skip
    for key, value in changes.items():  # memory__oom_breakdown: the memory section's oom_breakdown
        section, _, inner = key.partition("__")
        point[section] = {**point[section], inner: value} if inner else value
    return point


WRONG_TYPES = {
    "world_size": {"world_size": "two"},
    "world_size null": {"world_size": None},
    "peak": {"memory__peak_allocated_mib_max": "big"},
    "config": {"config": "x"},
    "eval": {"eval": "x"},
    "throughput": {"throughput": "x"},
    "param_digest": {"param_digest": "x"},
    "oom_breakdown": {"memory__oom_breakdown": "x"},
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_a_value_of_the_wrong_type_is_a_row_that_says_why(case, tmp_path):
    """One point's bad value never costs the others their report: its row names the file and
    the key; the rest is compared as usual."""
    from sharded_exp.report.publish import write_report

    _write_sweep(tmp_path, [_hand_made("ddp", 10.0), _hand_made("fsdp", 6.0, **WRONG_TYPES[case]),
                            _hand_made("zero1", 8.0)])  # fmt: skip
    rows = {r["strategy"]: r for r in write_report(tmp_path)}
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.csv").exists()
    bad = next(r for r in rows.values() if r["status"] not in ("ok",))
    key = case.split()[0]
    assert "1_strategy=fsdp" in bad["error"] and key in bad["error"], bad["error"]
    assert rows["zero1"]["peak_saving_pct"] == pytest.approx(20.0)  # the others, compared as usual
    assert "1 point(s) left no usable result.json (point 1)" in (tmp_path / "report.md").read_text()


def test_a_nan_peak_is_no_measurement():
    from sharded_exp.report.rows import build_rows
    from sharded_exp.report.text import headline

    def rows(*points):
        return build_rows([{**p, "output_dir": f"/s/{i}_{p['strategy']}"} for i, p in enumerate(points)])

    head = headline(rows(_hand_made("ddp", math.nan), _hand_made("fsdp", 6.0)))
    assert head == "At 2 ranks, only fsdp has a measured peak (6.00 MiB).", head
    head = headline(rows(_hand_made("ddp", math.nan)))
    assert "nan" not in head.lower(), head


def test_an_interrupted_report_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """Ctrl-C while a report is written (here: after its charts, before report.md) leaves the
    previous report's files as they were, and no staging directory; the next report replaces
    them all."""
    from sharded_exp.report import publish
    from sharded_exp.report.figures import CHARTS

    files = ("report.md", "report.csv", *CHARTS)
    _write_sweep(tmp_path, [_hand_made("ddp", 10.0), _hand_made("fsdp", 6.0)])
    publish.write_report(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in files}
    _write_sweep(tmp_path / "more", [_hand_made("zero1", 8.0)])  # a new point: every file changes

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(publish, "report_markdown", interrupted)
        with pytest.raises(KeyboardInterrupt):
            publish.write_report(tmp_path)
    assert {name: (tmp_path / name).read_bytes() for name in files} == before
    assert not list(tmp_path.glob(".report-*"))
    publish.write_report(tmp_path)
    assert [n for n in files if (tmp_path / n).read_bytes() != before[n]] == list(files)
    assert "zero1" in (tmp_path / "report.md").read_text() and not list(tmp_path.glob(".report-*"))


@pytest.mark.slow  # in the default tier in this process: unit/report/test_command.py (exit 1, the line, nothing written)
def test_the_report_of_an_empty_directory_writes_nothing(tmp_path):
    proc = run_cli([str(tmp_path)], cwd=ROOT, module="sharded_exp.report")
    assert proc.returncode == 1 and "no result.json" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def read_only_copy(tmp_path):
    """A read-only filesystem (tmpfs remounted ro) holding a copy of what ``fill`` puts there."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, timeout=60
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")

    def freeze(fill):
        fill(mount)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=60)
        return mount

    yield freeze
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)


@pytest.mark.slow
def test_read_only_destinations_and_w_and_b_without_a_key_get_an_error_line(tmp_path, read_only_copy):
    run = tmp_path / "run"
    assert cli([*TINY, "trainer.steps=2", "strategy=fsdp", "trainer.checkpoint_every=2", "logger=wandb"],
               run).returncode == 0  # fmt: skip
    ro = read_only_copy(lambda m: shutil.copytree(run, m / "sweep" / "0_point"))
    # the report of a sweep directory that cannot be written
    proc = run_cli([str(ro / "sweep")], cwd=ROOT, module="sharded_exp.report")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: report not written in {ro / 'sweep'}: Read-only file system" in proc.stderr
    # a checkpoint exported to a read-only destination
    proc = run_cli(["export", str(run / "checkpoints" / "step_00000002"), str(ro / "exported")], cwd=ROOT,
                   module="sharded_exp.checkpoint")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: cannot export to {ro / 'exported'}: Read-only file system" in proc.stderr
    # the W&B workspace saved online without an API key
    sweep = tmp_path / "sweep"
    shutil.copytree(run, sweep / "0_point")
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path / "home"), "WANDB_CONFIG_DIR": str(tmp_path / "wb")}
    proc = run_cli([str(sweep), "--wandb-workspace", "--online"], cwd=ROOT, env=env, module="sharded_exp.report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: W&B: No API key configured" in proc.stderr
