"""The report put in place: report.md, report.csv and the charts moved into the sweep
directory together, and, when the sweep logged to W&B, a "report" run in its group with the
table, W&B's own charts and the PNGs (:func:`write_report`).
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from sharded_exp.output.charts import ranks
from sharded_exp.output.loggers import finish_run, init_wandb_run
from sharded_exp.report.figures import CHARTS, write_charts
from sharded_exp.report.planned import add_planned
from sharded_exp.report.rows import COLUMNS, build_rows, columns, point_row
from sharded_exp.report.sweep_points import SWEEP_ID, load_points, point_name
from sharded_exp.report.text import report_markdown
from sharded_exp.report.workspace import sweep_logger
from sharded_exp.vocabulary.wandb_names import REPORT_JOB_TYPE, report_key, report_run_id, report_run_name


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    """report.md, report.csv, the charts and the W&B report run; nothing when the
    directory holds no result.json (returns the rows, empty then). The files are written in
    a staging directory beside them and moved into place together (:func:`publish_report`)."""
    sweep_dir = Path(sweep_dir)
    stale: list[dict[str, Any]] = []
    points = load_points(sweep_dir, stale)
    note = ""
    if stale:
        names = ", ".join(sorted(point_name(p) for p in stale))
        note = f"\n\n{len(stale)} point(s) left here by an earlier sweep are not in this report: {names}."
        print(f"report: {len(stale)} stale point(s) of an earlier sweep left out ({names}); this sweep's id is in "
              f"{sweep_dir / SWEEP_ID}", file=sys.stderr)  # fmt: skip
    if not points:
        return []
    rows = build_rows(points)
    add_planned(rows, points)  # report.device_profile: the headline's planned GPU ratios (none: nothing)
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=sweep_dir))
    try:
        drawn = {p.name for p in write_charts(rows, staging)}
        (staging / "report.md").write_text(report_markdown(rows, sweep_dir.name, note, drawn))
        with open(staging / "report.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns(rows), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        publish_report(staging, sweep_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log_to_wandb(rows, points, [sweep_dir / name for name in CHARTS if name in drawn], sweep_dir)
    return rows


def publish_report(staging: Path, sweep_dir: Path) -> None:
    """Move the report's files from ``staging`` into ``sweep_dir``, replacing the previous
    report's; a chart of the previous report not drawn this time goes (report.md no longer
    links it). Each file is renamed in place (atomic), with SIGINT and SIGTERM held until the
    last is in: a Ctrl-C leaves the previous complete set or the new one, never a mix."""
    block = getattr(signal, "pthread_sigmask", None)  # not on Windows: the renames alone
    held = block(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}) if block else None
    try:
        for name in CHARTS:
            if not (staging / name).exists():
                (sweep_dir / name).unlink(missing_ok=True)
        for name in (*CHARTS, "report.csv", "report.md"):
            if (staging / name).exists():
                os.replace(staging / name, sweep_dir / name)
    finally:
        if block:
            block(signal.SIG_SETMASK, held)


def _label(row: dict[str, Any]) -> str:
    return f"{row['strategy']} | {ranks(row['world_size'])} | precision {row['precision']} | {row['model']}"


def native_charts(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison as W&B tables and W&B's own charts built from them (filterable and
    regroupable in the UI): bars of per-rank peak and model states by strategy, labelled
    and ordered by world size and precision; predicted vs measured peak; samples/s."""
    import wandb  # lazy: wandb takes about half a second to import; only a sweep that logged to W&B needs it

    columns = ["label", *COLUMNS]
    table = wandb.Table(columns=columns, data=[[_label(row), *(row[c] for c in COLUMNS)] for row in rows])
    per_rank = wandb.Table(
        columns=[
            "label",
            "strategy",
            "world_size",
            "precision",
            "model",
            "rank",
            "peak_allocated_mib",
            "predicted_peak_mib",
            "model_states_mib",
        ],
        data=[
            [
                f"{_label(point_row(p))} | rank {e['rank']}",
                p["strategy"],
                p["world_size"],
                p["precision"],
                p["model"],
                e["rank"],
                e.get("peak_allocated_mib"),
                e.get("predicted_peak_mib"),
                sum(e["model_states_mib"].values()) if e.get("model_states_mib") else None,
            ]
            for p in points
            if p.get("status") == "ok"
            for e in (p.get("memory") or {}).get("per_rank", [])
        ],
    )
    # Bars only for the points that finished: a point that ran out of memory has no
    # throughput, and a bar of 0 would read as the slowest (report/table names it).
    speeds = wandb.Table(
        columns=["label", "samples_per_s"],
        data=[
            [_label(row), row["samples_per_s"]]
            for row in rows
            if row.get("status") == "ok" and row.get("samples_per_s") is not None
        ],
    )
    plot = wandb.plot
    return {
        report_key("table"): table,
        report_key("per_rank"): per_rank,
        report_key("peak_per_rank"): plot.bar(
            per_rank, "label", "peak_allocated_mib", title="Peak allocated per rank (MiB)"
        ),
        report_key("model_states_per_rank"): plot.bar(
            per_rank, "label", "model_states_mib", title="Model states per rank (MiB)"
        ),
        report_key("predicted_vs_measured"): plot.scatter(
            per_rank, "predicted_peak_mib", "peak_allocated_mib", title="Peak per rank: predicted vs measured (MiB)"
        ),
        report_key("samples_per_s"): plot.bar(
            speeds, "label", "samples_per_s", title="Throughput (samples/s, all ranks; points that finished)"
        ),
    }


def log_to_wandb(rows: list[dict[str, Any]], points: list[dict[str, Any]], images: list[Path], sweep_dir: Path) -> None:
    """The tables, W&B's own charts and the PNGs in one "report" run of the sweep's W&B
    group, if the sweep used W&B."""
    cfg = sweep_logger(points)
    if cfg is None:
        return
    try:
        import wandb  # lazy: (as above)

        # One report run per sweep directory: a fixed id, and an earlier local copy removed,
        # so that reporting again replaces the run instead of adding one.
        run_id = report_run_id(sweep_dir)
        for old in (Path(sweep_dir) / "wandb").glob(f"*-{run_id}"):
            shutil.rmtree(old, ignore_errors=True)
        run = init_wandb_run(
            cfg,
            job_type=REPORT_JOB_TYPE,
            name=report_run_name(sweep_dir),
            config=None,
            directory=str(sweep_dir),
            run_id=run_id,
        )
        run.log({**native_charts(rows, points), **{report_key(p.stem): wandb.Image(str(p)) for p in images}})
        finish_run(run)
    except Exception as exc:  # noqa: BLE001 -- the report files are written regardless
        print(f"warning: W&B summary run not written ({type(exc).__name__}: {exc})", file=sys.stderr)
