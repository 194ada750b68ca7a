"""The comparison of a sweep's points, built from their ``result.json`` files.

:func:`write_report` writes ``report.md``, ``report.csv``, ``memory.png`` and
``throughput.png`` in the sweep directory (and, when the sweep logged to W&B, a "report"
run in its group with the table and charts): one row per point, with the saving and the
speed relative to the DDP point of the same (model, precision, world size). The command
and the multirun callback are in :mod:`sharded_exp.report`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from sharded_exp.output.loggers import init_wandb_run
from sharded_exp.output.workspace import sweep_logger

COLUMNS = [
    "strategy", "world_size", "precision", "model", "params", "peak_allocated_mib_max", "predicted_peak_mib_max",
    "peak_rel_error_max", "model_states_mib_max", "predicted_model_states_mib_max", "peak_saving_vs_ddp_pct",
    "states_saving_vs_ddp_pct", "samples_per_s", "speed_vs_ddp", "mfu", "final_loss", "eval/accuracy", "eval/f1", "eval/perplexity", "parity_vs_ddp", "status", "first_nonfinite_step", "error",
]  # fmt: skip


SWEEP_ID = ".sweep_id"
"""In a sweep directory: the id of the sweep that last started there. Each point records
it in its result.json, so a report leaves out the points an earlier sweep left behind."""


def sweep_id(sweep_dir: str | Path) -> str | None:
    """The id of the sweep that last started in ``sweep_dir`` (None if it has none)."""
    try:
        return (Path(sweep_dir) / SWEEP_ID).read_text().strip() or None
    except OSError:
        return None


def load_points(sweep_dir: Path, stale: list | None = None) -> list[dict[str, Any]]:
    """One result.json per point of the sweep that last ran in ``sweep_dir``: earlier
    attempts archived in ``attempts/`` are not points, nor are the points an earlier sweep
    left in a reused directory (another sweep id; appended to ``stale`` when given)."""
    sweep_dir = Path(sweep_dir)
    paths = [p for p in sorted(sweep_dir.rglob("result.json")) if "attempts" not in p.relative_to(sweep_dir).parts]
    points = [_read_point(p) for p in paths]
    current = sweep_id(sweep_dir)
    if current is None:
        return points
    mine = lambda p: p.get("sweep_id") == current or p.get("status") == "unreadable"  # noqa: E731
    if stale is not None:
        stale.extend(p for p in points if not mine(p))
    return [p for p in points if mine(p)]


REQUIRED = ("status", "strategy", "world_size", "precision", "model")


def _read_point(path: Path) -> dict[str, Any]:
    """A point's result.json; one that cannot be read, or lacks what a row needs, becomes a
    point that says why (the report is written either way)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError) as exc:
        return {"status": "unreadable", "error": f"{path}: {exc}", "output_dir": str(path.parent)}
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        status = data.get("status") if isinstance(data.get("status"), str) else "incomplete"
        why = "still running or killed before it finished" if status == "running" else "incomplete"
        return {
            **data,
            "status": status,
            "error": f"{path}: {why} (no {', '.join(missing)})",
            "output_dir": str(path.parent),
        }
    return data


def _row(r: dict[str, Any]) -> dict[str, Any]:
    mem = r.get("memory") or {}
    return {
        "strategy": r.get("strategy", "?"),
        "world_size": r.get("world_size", 0),
        "precision": str(r.get("precision", "?")),
        "model": r.get("model", "?"),
        "params": r.get("params"),
        "peak_allocated_mib_max": mem.get("peak_allocated_mib_max"),
        "model_states_mib_max": mem.get("model_states_mib_max"),
        "predicted_model_states_mib_max": mem.get("predicted_model_states_mib_max"),
        "predicted_peak_mib_max": mem.get("predicted_peak_mib_max"),
        "peak_rel_error_max": mem.get("peak_rel_error_max"),
        "samples_per_s": (r.get("throughput") or {}).get("samples_per_s"),
        "mfu": (r.get("throughput") or {}).get("mfu"),
        "final_loss": r.get("final_loss"),
        **{
            k: ((r.get("eval") or {}).get("final") or {}).get(k)
            for k in ("eval/accuracy", "eval/f1", "eval/perplexity")
        },
        "param_l2": (r.get("param_digest") or {}).get("l2"),
        "status": r.get("status", "?"),
        "first_nonfinite_step": r.get("first_nonfinite_step"),
        "error": r.get("error"),
    }


AS_COLUMNS = ("strategy", "trainer.world_size", "precision", "model")
"""Overrides that are report columns of their own."""


def _overrides(point: dict[str, Any]) -> dict[str, str] | None:
    """A point's command-line overrides as {key: value} (``+``/``++`` dropped), from its
    result.json or, for an older one, its .hydra/overrides.yaml; None if unknown."""
    found = point.get("overrides")
    if found is None and point.get("output_dir"):
        try:
            import yaml

            found = yaml.safe_load((Path(point["output_dir"]) / ".hydra" / "overrides.yaml").read_text())
        except (OSError, ValueError):
            found = None
    if not isinstance(found, list):
        return None
    pairs = (str(o).lstrip("+").partition("=")[::2] for o in found)
    return {key: value.replace("'", "") for key, value in pairs}  # precision='32' as typed: 32


def _point_name(point: dict[str, Any]) -> str:
    """A point as the report names it: ``point 3`` for a sweep's 3_<overrides>/, else its
    directory's name."""
    name = Path(point.get("output_dir") or "?").name
    number = name.split("_", 1)[0]
    return f"point {number}" if number.isdigit() else name


def swept_keys(points: list[dict[str, Any]]) -> list[str]:
    """Overrides whose value differs between points (beyond the report's own columns)."""
    known = [o for o in (_overrides(p) for p in points) if o is not None]
    keys = dict.fromkeys(k for o in known for k in o)
    return [k for k in keys if k not in AS_COLUMNS and len({o.get(k) for o in known}) > 1]


def build_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, compared with its baseline: the DDP point whose settings differ
    only in the strategy (same model, precision, world size and every other swept
    override), or none, which the row's ``baseline`` says."""
    swept = swept_keys(points)
    rows = []
    for point in points:
        row = _row(point)
        overrides = _overrides(point) or {}
        for k in swept:
            row[k] = overrides.get(k)
        row["_dir"] = _point_name(point)
        rows.append(row)
    key = lambda row: (row["model"], row["precision"], row["world_size"], *(row[k] for k in swept))  # noqa: E731
    ddp_points = {key(row): row for row in rows if row["strategy"] == "ddp"}
    for row in rows:
        found = ddp_points.get(key(row))
        if found is None:
            row["baseline"] = "none: no ddp point with the same settings"
        elif found["status"] != "ok":
            row["baseline"] = f"none: ddp ({found['_dir']}) ended {found['status']}"
        else:
            row["baseline"] = "itself" if found is row else f"ddp ({found['_dir']})"
        # Savings, speed and parity only between points that trained to a finite end.
        base = found if found is not None and found["status"] == "ok" and row["status"] == "ok" else None
        for col, metric in (
            ("peak_saving_vs_ddp_pct", "peak_allocated_mib_max"),
            ("states_saving_vs_ddp_pct", "model_states_mib_max"),
        ):
            ok = base and row[metric] is not None and base[metric]
            row[col] = 100 * (1 - row[metric] / base[metric]) if ok else None
        ok = base and row["samples_per_s"] and base["samples_per_s"]
        row["speed_vs_ddp"] = row["samples_per_s"] / base["samples_per_s"] if ok else None
        # relative difference of the parameters' L2 norm from DDP's (same steps, same data)
        ok = base and row["param_l2"] is not None and base["param_l2"]
        row["parity_vs_ddp"] = abs(row["param_l2"] - base["param_l2"]) / base["param_l2"] if ok else None
    order = ["ddp", "oss", "sharded_ddp", "zero1", "fsdp_grad_op", "fsdp"]
    rank = lambda s: order.index(s) if s in order else len(order)  # noqa: E731
    return sorted(rows, key=lambda r: (*(str(x) for x in key(r)), rank(r["strategy"])))


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The report's columns: the fixed ones, each swept override, and the baseline."""
    swept = [k for k in (rows[0] if rows else {}) if k not in COLUMNS and k not in _row({}) and k[0] != "_"]
    swept = [k for k in swept if k != "baseline"]
    return COLUMNS[:4] + swept + COLUMNS[4:] + ["baseline"]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.2e}"
    if isinstance(value, int) and value > 9999:
        return f"{value:,}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def write_charts(rows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    """memory.png and throughput.png: one bar per strategy, grouped by world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    charts = (
        ("memory.png", "peak_allocated_mib_max", "Peak allocated memory per rank (MiB, max over ranks)"),
        ("throughput.png", "samples_per_s", "Throughput (samples/s, all ranks)"),
    )
    for filename, metric, title in charts:
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        groups = list(dict.fromkeys((r["model"], r["precision"], r["world_size"]) for r in rows))
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(strategies) * max(1, len(groups)) / 2), 4.5))
        width = 0.8 / max(1, len(groups))
        for g, group in enumerate(groups):
            values = [
                next(
                    (
                        r[metric] or 0
                        for r in rows
                        if r["strategy"] == s and (r["model"], r["precision"], r["world_size"]) == group
                    ),
                    0,
                )
                for s in strategies
            ]
            xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(strategies))]
            bars = ax.bar(xs, values, width, label=f"{group[0]}, precision {group[1]}, {group[2]} ranks")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(strategies)), strategies)
        ax.set_ylabel(title.split(" (")[1].rstrip(")") if "(" in title else metric)
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(sweep_dir) / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _label(row: dict[str, Any]) -> str:
    return f"{row['strategy']} | {row['world_size']} ranks | precision {row['precision']} | {row['model']}"


def native_charts(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison as W&B tables and W&B's own charts built from them (filterable and
    regroupable in the UI): bars of per-rank peak and model states by strategy, labelled
    and ordered by world size and precision; predicted vs measured peak; samples/s."""
    import wandb

    columns = ["label", *COLUMNS]
    table = wandb.Table(columns=columns, data=[[_label(row), *(row[c] for c in COLUMNS)] for row in rows])
    per_rank = wandb.Table(
        columns=["label", "strategy", "world_size", "precision", "model", "rank", "peak_allocated_mib",
                 "predicted_peak_mib", "model_states_mib"],
        data=[
            [f"{_label(_row(p))} | rank {e['rank']}", p["strategy"], p["world_size"], p["precision"], p["model"],
             e["rank"], e.get("peak_allocated_mib"), e.get("predicted_peak_mib"),
             sum(e["model_states_mib"].values()) if e.get("model_states_mib") else None]
            for p in points if p.get("status") == "ok" for e in (p.get("memory") or {}).get("per_rank", [])
        ],
    )  # fmt: skip
    plot = wandb.plot
    return {
        "report/table": table,
        "report/per_rank": per_rank,
        "report/peak_per_rank": plot.bar(
            per_rank, "label", "peak_allocated_mib", title="Peak allocated per rank (MiB)"
        ),
        "report/model_states_per_rank": plot.bar(
            per_rank, "label", "model_states_mib", title="Model states per rank (MiB)"
        ),
        "report/predicted_vs_measured": plot.scatter(
            per_rank, "predicted_peak_mib", "peak_allocated_mib", title="Peak per rank: predicted vs measured (MiB)"
        ),
        "report/samples_per_s": plot.bar(table, "label", "samples_per_s", title="Throughput (samples/s, all ranks)"),
    }


def log_to_wandb(rows: list[dict[str, Any]], points: list[dict[str, Any]], charts: list[Path], sweep_dir: Path) -> None:
    """The tables, W&B's own charts and the PNGs in one "report" run of the sweep's W&B
    group, if the sweep used W&B."""
    cfg = sweep_logger(points)
    if cfg is None:
        return
    try:
        import wandb

        # One report run per sweep directory: a fixed id, and an earlier local copy removed,
        # so that reporting again replaces the run instead of adding one.
        run_id = "report-" + hashlib.sha1(str(Path(sweep_dir).resolve()).encode()).hexdigest()[:12]
        for old in (Path(sweep_dir) / "wandb").glob(f"*-{run_id}"):
            shutil.rmtree(old, ignore_errors=True)
        run = init_wandb_run(
            cfg, job_type="report", name=f"report {Path(sweep_dir).name}", config=None, directory=str(sweep_dir),
            run_id=run_id,
        )  # fmt: skip
        run.log({**native_charts(rows, points), **{f"report/{p.stem}": wandb.Image(str(p)) for p in charts}})
        run.finish()
    except Exception as exc:  # noqa: BLE001 -- the report files are written regardless
        print(f"warning: W&B summary run not written ({type(exc).__name__}: {exc})", file=sys.stderr)


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    """report.md, report.csv, the charts and the W&B report run; nothing when the
    directory holds no result.json (returns the rows, empty then)."""
    sweep_dir = Path(sweep_dir)
    stale: list[dict[str, Any]] = []
    points = load_points(sweep_dir, stale)
    if not points:
        return []
    rows = build_rows(points)
    note = ""
    if stale:
        names = ", ".join(sorted(_point_name(p) for p in stale))
        note = f"\n\n{len(stale)} point(s) left here by an earlier sweep are not in this report: {names}."
        print(f"report: {len(stale)} stale point(s) of an earlier sweep left out ({names})", file=sys.stderr)
    (sweep_dir / "report.md").write_text(
        f"# Sweep report: {sweep_dir.name}\n\nMemory in MiB, max over ranks; savings, speed and parity relative to "
        "each row's baseline: the DDP point whose settings differ only in the strategy." + note + "\n\n"
        + markdown(rows) + "\n"
    )  # fmt: skip
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    charts = write_charts(rows, sweep_dir)
    log_to_wandb(rows, points, charts, sweep_dir)
    return rows
