"""The comparison of a sweep's points, built from their ``result.json`` files.

:func:`write_report` writes ``report.md`` (a headline computed from the sweep, a compact
table, the charts, every column), ``report.csv`` and the charts (:mod:`charts`) in the
sweep directory, and, when the sweep logged to W&B, a "report" run in its group with the
table and charts: one row per point, with the saving and the speed relative to its
baseline (DDP at the same settings, else the least sharded point that fits). The command
and the multirun callback are in :mod:`sharded_exp.report`.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from sharded_exp.job.result import read_result
from sharded_exp.output import charts
from sharded_exp.output.charts import ranks
from sharded_exp.output.loggers import init_wandb_run
from sharded_exp.output.workspace import sweep_logger
from sharded_exp.strategies import STRATEGIES, baseline, by_sharding, sharding_order
from sharded_exp.vocabulary.wandb_names import REPORT_JOB_TYPE, report_key, report_run_id, report_run_name

COLUMNS = [
    "strategy", "world_size", "precision", "model", "params", "peak_allocated_mib_max", "peak_allocated_mib_mean",
    "predicted_peak_mib_max", "predicted_peak_mib_mean", "peak_rel_error_max", "model_states_mib_max",
    "predicted_model_states_mib_max", "memory_limit_mib", "peak_saving_pct", "peak_mean_saving_pct",
    "states_saving_pct", "samples_per_s", "samples_per_s_ci95_low", "samples_per_s_ci95_high", "speed_vs_baseline",
    "speed_vs_baseline_ci95_low", "speed_vs_baseline_ci95_high", "speed_within_noise", "timed_steps", "device",
    "threads_per_rank", "load_avg_1m", "cpu_count", "mfu_pct", "final_loss",
    "eval/accuracy", "eval/f1", "eval/perplexity", "parity_vs_baseline", "status", "first_nonfinite_step", "error",
    "oom_breakdown",
]  # fmt: skip
"""Every column of report.csv and the full table (the swept overrides follow ``model``,
``baseline`` comes last)."""
COMPACT = {
    "strategy": "strategy", "world_size": "world_size", "precision": "precision",
    "peak_allocated_mib_max": "peak_allocated_mib_max", "peak_allocated_mib_mean": "peak_allocated_mib_mean",
    "predicted_peak_mib_max": "predicted_peak_mib_max", "peak_saving_pct": "peak_saving_pct",
    "samples_per_s": "samples_per_s", "speed_vs_baseline": "speed_vs_baseline", "status": "status",
    "baseline_short": "baseline",
}  # fmt: skip
"""The table a reader reads first: column -> header (the end-of-run table's abbreviations)."""
"""Strategies from the least sharded to the most: the report's row order, and the order in
which a baseline is chosen when DDP did not run to the end."""


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
    """A point's result.json; one that cannot be read, holds a value of the wrong type for
    its schema (:class:`sharded_exp.job.result.Result`, strictly: ``"world_size": "2"`` is
    no number), or lacks what a row needs, becomes a point that says why (the report is
    written either way). Missing and unknown keys are not type errors: an older or a newer
    result.json still makes its row."""
    try:
        data = read_result(str(path), partial=True).as_written()
    except (OSError, ValueError) as exc:
        return {"status": "unreadable", "error": f"{path}: {exc}", "output_dir": str(path.parent)}
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        status = data.get("status") if data.get("status") not in (None, "ok") else "incomplete"
        why = "still running or killed before it finished" if status == "running" else "incomplete"
        return {
            **data,
            "status": status,
            "error": f"{path}: {why} (no {', '.join(missing)})",
            "output_dir": str(path.parent),
        }
    return data


def oom_summary(breakdown: dict[str, Any] | None) -> str | None:
    """A CPU run's record of the moment it went over its budget, in one cell: where, the
    categories (largest first) and the modules holding most of it."""
    if not breakdown:
        return None
    where = f"rank {breakdown.get('rank')}" + (
        f" step {breakdown['step']}" if breakdown.get("step") is not None else ""
    )
    categories = sorted((breakdown.get("by_category_mib") or {}).items(), key=lambda kv: -kv[1])
    modules = list((breakdown.get("top_modules_mib") or {}).items())[:3]
    parts = [
        f"{where} ({breakdown.get('phase')}): {breakdown.get('tracked_mib', 0):.2f} MiB over {breakdown.get('limit_mib')}",
        ", ".join(f"{k} {v:.2f}" for k, v in categories if v > 0),
    ]
    if modules:
        parts.append("top modules " + ", ".join(f"{k} {v:.2f}" for k, v in modules))
    return "; ".join(parts)


def _mean_over_ranks(mem: dict[str, Any], key: str) -> float | None:
    """``memory.<key>_mean``, or for a result.json written before it existed, the average of
    the ranks' ``<key>`` (None unless every rank has one)."""
    if f"{key}_mean" in mem:
        return mem[f"{key}_mean"]
    values = [e.get(key) for e in mem.get("per_rank") or []]
    return sum(values) / len(values) if values and all(v is not None for v in values) else None


def _row(r: dict[str, Any]) -> dict[str, Any]:
    mem = r.get("memory") or {}
    tp = r.get("throughput") or {}
    return {
        "strategy": r.get("strategy", "?"),
        "world_size": r.get("world_size") or 0,  # null: no usable world size (an incomplete point)
        "precision": str(r.get("precision", "?")),
        "model": r.get("model", "?"),
        "params": r.get("params"),
        "peak_allocated_mib_max": mem.get("peak_allocated_mib_max"),
        "peak_allocated_mib_mean": _mean_over_ranks(mem, "peak_allocated_mib"),
        "predicted_peak_mib_mean": _mean_over_ranks(mem, "predicted_peak_mib"),
        "model_states_mib_max": mem.get("model_states_mib_max"),
        "predicted_model_states_mib_max": mem.get("predicted_model_states_mib_max"),
        "predicted_peak_mib_max": mem.get("predicted_peak_mib_max"),
        "peak_rel_error_max": mem.get("peak_rel_error_max"),
        "memory_limit_mib": ((r.get("config") or {}).get("trainer") or {}).get("memory_limit_mib"),
        "samples_per_s": tp.get("samples_per_s"),
        "samples_per_s_ci95_low": tp.get("samples_per_s_ci95_low"),
        "samples_per_s_ci95_high": tp.get("samples_per_s_ci95_high"),
        "step_time_s_iqr": tp.get("step_time_s_iqr"),
        "timed_steps": tp.get("timed_steps"),
        "min_timed_steps": ((r.get("config") or {}).get("trainer") or {}).get("min_timed_steps"),
        "device": (r.get("device") or {}).get("type"),
        "threads_per_rank": (r.get("device") or {}).get("threads_per_rank"),
        "load_avg_1m": tp.get("load_avg_1m"),
        "cpu_count": tp.get("cpu_count"),
        "mfu_pct": tp.get("mfu_pct"),
        "final_loss": r.get("final_loss"),
        **{
            k: ((r.get("eval") or {}).get("final") or {}).get(k)
            for k in ("eval/accuracy", "eval/f1", "eval/perplexity")
        },
        "param_l2": (r.get("param_digest") or {}).get("l2"),
        "status": r.get("status", "?"),
        "first_nonfinite_step": r.get("first_nonfinite_step"),
        "error": r.get("error"),
        "oom_breakdown": oom_summary(mem.get("oom_breakdown")),
        # an out-of-memory's one number: what was live when the budget was first crossed (CPU tracker)
        "oom_at_mib": (mem.get("oom_breakdown") or {}).get("tracked_mib"),
        "batch_size": ((r.get("config") or {}).get("trainer") or {}).get("batch_size"),
        # for the charts, not columns: each rank's figures and the prediction's split
        "per_rank": mem.get("per_rank") or [],
        "peak_prediction": mem.get("peak_prediction") or {},
        "oom_categories": (mem.get("oom_breakdown") or {}).get("by_category_mib"),
    }


AS_COLUMNS = ("strategy", "trainer.world_size", "precision", "model")
"""Overrides that are report columns of their own."""
REPEATS = ("trainer.seed",)
"""Overrides that repeat a point rather than change it: points that differ only in them are
compared with each other (the first one is the baseline), as a measure of the noise."""


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


def _measured(row: dict[str, Any]) -> bool:
    """The point trained to a finite end and its peak was measured (a finite number: a NaN
    peak is no measurement): it can be compared."""
    peak = row["peak_allocated_mib_max"]
    return row["status"] == "ok" and peak is not None and math.isfinite(peak)


def _choose_baseline(members: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    """The baseline of points that differ only in the strategy, and why it is not DDP:
    DDP when it ran to the end; else the least sharded point that fits (``Strategy.sharding``), so a
    saving reads as what more sharding buys; None when fewer than two points fit."""
    ddp = next((r for r in members if r["strategy"] == baseline()), None)
    if ddp is not None and ddp["status"] == "ok":
        return ddp, None
    why = "no ddp point with the same settings" if ddp is None else f"ddp ({ddp['_dir']}) ended {ddp['status']}"
    fitting = [r for r in members if r["status"] == "ok"]
    if len(fitting) < 2:
        return None, why
    return min(fitting, key=lambda r: (_order(r["strategy"]), r["peak_allocated_mib_max"] or math.inf)), why


def _order(strategy: str) -> tuple[int, str]:
    """Where a strategy stands from the least sharded to the most (the registry's ``sharding``)."""
    return sharding_order(strategy)


def build_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, compared with its baseline (:func:`_choose_baseline`) among the
    points whose settings differ only in the strategy (same model, precision, world size
    and every other swept override); ``baseline`` says which point that is, or why none."""
    swept = swept_keys(points)
    rows = []
    for point in points:
        row = _row(point)
        overrides = _overrides(point) or {}
        for k in swept:
            row[k] = overrides.get(k)
        row["_dir"] = _point_name(point)
        row["_group"] = (row["model"], row["precision"], *(str(row[k]) for k in swept if k not in REPEATS))
        rows.append(row)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((*row["_group"], row["world_size"]), []).append(row)
    for members in groups.values():
        base, why = _choose_baseline(members)
        for row in members:
            row["_base"] = base
            if base is None:
                row["baseline"], row["baseline_short"] = f"none: {why}", "none"
            elif base is row:
                row["baseline"], row["baseline_short"] = "itself" + (f": {why}" if why else ""), "itself"
            else:
                row["baseline"] = f"{base['strategy']} ({base['_dir']})" + (f": {why}" if why else "")
                row["baseline_short"] = base["strategy"] + (" (ddp did not fit)" if why and "oom" in why else "")
            _compare(row, base if base is not None and row["status"] == "ok" else None)
    return sorted(rows, key=lambda r: (r["_group"], r["world_size"], _order(r["strategy"])))


def _compare(row: dict[str, Any], base: dict[str, Any] | None) -> None:
    """Savings, speed and parity only between points that trained to a finite end."""
    for col, metric in (("peak_saving_pct", "peak_allocated_mib_max"), ("peak_mean_saving_pct", "peak_allocated_mib_mean"),
                        ("states_saving_pct", "model_states_mib_max")):  # fmt: skip
        ok = base and row[metric] is not None and base[metric]
        row[col] = 100 * (1 - row[metric] / base[metric]) if ok else None
    ok = base and row["samples_per_s"] and base["samples_per_s"]
    row["speed_vs_baseline"] = row["samples_per_s"] / base["samples_per_s"] if ok else None
    row["speed_vs_baseline_ci95_low"], row["speed_vs_baseline_ci95_high"] = (
        speed_interval(row, base) if ok else (None, None)
    )
    low, high = row["speed_vs_baseline_ci95_low"], row["speed_vs_baseline_ci95_high"]
    row["speed_within_noise"] = (low <= 1.0 <= high) if low is not None and base is not row else None
    # relative difference of the parameters' L2 norm from the baseline's (same steps, same data)
    ok = base and row["param_l2"] is not None and base["param_l2"]
    row["parity_vs_baseline"] = abs(row["param_l2"] - base["param_l2"]) / base["param_l2"] if ok else None


def speed_interval(row: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, float | None]:
    """A 95% interval of ``row``'s speed over ``base``'s, from the two medians' intervals
    (the lowest over the highest, the highest over the lowest: a conservative interval,
    as the two are measured apart). (None, None) when either point timed too few steps."""
    a_low, a_high = row["samples_per_s_ci95_low"], row["samples_per_s_ci95_high"]
    b_low, b_high = base["samples_per_s_ci95_low"], base["samples_per_s_ci95_high"]
    if None in (a_low, a_high, b_low, b_high) or not b_low:
        return None, None
    return a_low / b_high, a_high / b_low


def speed_text(row: dict[str, Any]) -> str:
    """``0.52x (0.48-0.57)``, or ``1.03x (0.91-1.15, within noise)``."""
    ratio, low, high = (
        row["speed_vs_baseline"],
        row.get("speed_vs_baseline_ci95_low"),
        row.get("speed_vs_baseline_ci95_high"),
    )
    if low is None:
        return f"{ratio:.2f}x (no interval: too few timed steps)"
    return f"{ratio:.2f}x ({low:.2f}-{high:.2f}{', within noise' if low <= 1.0 <= high else ''})"


def swept_of(rows: list[dict[str, Any]]) -> list[str]:
    """The swept overrides that are columns of their own (keys of the rows)."""
    known = (
        set(COLUMNS)
        | set(_row({}))
        | {
            "baseline",
            "baseline_short",
            "parity_vs_baseline",
            "speed_vs_baseline",
            "speed_vs_baseline_ci95_low",
            "speed_vs_baseline_ci95_high",
            "speed_within_noise",
        }
    )
    return [k for k in (rows[0] if rows else {}) if k not in known and k[0] != "_"]


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The report's columns: the fixed ones, each swept override, and the baseline."""
    return COLUMNS[:4] + swept_of(rows) + COLUMNS[4:] + ["baseline"]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.2e}"
    if isinstance(value, int) and value > 9999:
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")  # one markdown cell


def _table(rows: list[dict[str, Any]], cols: list[str], headers: list[str], fmt=_fmt) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(c, row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """Every column, one row per point."""
    cols = columns(rows)
    return _table(rows, cols, cols, lambda c, v: _fmt(v))


def _compact_cell(col: str, value: Any) -> str:
    if value is None:
        return "-"
    if col == "peak_saving_pct":
        return f"{value:.1f}"
    if col == "speed_vs_baseline":
        return f"{value:.2f}x"  # its interval: the full table and the headline
    if isinstance(value, float):
        return charts.num(value)
    return _fmt(value)


def compact(rows: list[dict[str, Any]]) -> str:
    """The columns a reader reads first (:data:`COMPACT`), the swept overrides beside the
    strategy, the model only when it varies."""
    swept = swept_of(rows)
    cols = list(COMPACT)[:3] + (["model"] if len({r["model"] for r in rows}) > 1 else []) + swept + list(COMPACT)[3:]
    return _table(rows, cols, [COMPACT.get(c, c) for c in cols], _compact_cell)


# ------------------------------------------------------------------------ the headline
def _ranks_list(sizes: list[int]) -> str:
    """[1, 2, 4] -> "1, 2 or 4 ranks"."""
    sizes = sorted(sizes)
    words = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    return f"{words} rank" + ("" if sizes == [1] else "s")


def _baseline_aside(base: dict[str, Any], members: list[dict[str, Any]]) -> str:
    """Why the baseline is not DDP, in the headline's words ("" when it is)."""
    ddp = next((r for r in members if r["strategy"] == baseline()), None)
    if base["strategy"] == baseline():
        return ""
    if ddp is None:
        return "the least sharded strategy here"
    return "the least sharded strategy that fits" if ddp["status"] == "oom" else "the least sharded that ran to the end"


def limit_text(limit: float | None) -> str:
    return f" in {limit:g} MiB" if limit else ""


def _at_world_size(ws: int, members: list[dict[str, Any]]) -> str:
    """One sentence on the points of one world size that differ only in the strategy."""
    fitting = [r for r in members if _measured(r)]
    oom = [r for r in members if r["status"] == "oom"]
    within = limit_text(next((r["memory_limit_mib"] for r in oom if r["memory_limit_mib"]), None))
    unmeasured = [r for r in members if r["status"] == "ok" and not _measured(r)]  # ran, but no (finite) peak
    if not fitting:
        if oom:
            return f"At {ranks(ws)}, nothing fits{within}."
        return f"At {ranks(ws)}, " + ("no point's peak was measured." if unmeasured else "no point ran to the end.")
    if len(fitting) == 1:
        (only,) = fitting
        peak = f"{charts.num(only['peak_allocated_mib_max'])} MiB"
        if len(members) == 1:
            return (
                f"At {ranks(ws)}, {only['strategy']} peaks at {peak} ({charts.num(only['samples_per_s'])} samples/s)."
            )
        verb = f"fits{within}" if oom else "has a measured peak" if unmeasured else "ran to the end"
        return f"At {ranks(ws)}, only {only['strategy']} {verb} ({peak})."
    base = fitting[0]["_base"]
    lowest = min(fitting, key=lambda r: r["peak_allocated_mib_max"])
    if lowest is base or base is None or lowest["peak_saving_pct"] is None:  # (a baseline without a peak)
        text = (f"At {ranks(ws)}, {lowest['strategy']} has the lowest peak "
                f"({charts.num(lowest['peak_allocated_mib_max'])} MiB)")  # fmt: skip
    else:
        aside = _baseline_aside(base, members)
        text = (f"At {ranks(ws)}, {lowest['strategy']} peaks {lowest['peak_saving_pct']:.0f}% below {base['strategy']} "
                f"({charts.num(lowest['peak_allocated_mib_max'])} vs {charts.num(base['peak_allocated_mib_max'])} MiB)"
                + (f", {aside}" if aside else ""))  # fmt: skip
        if lowest["speed_vs_baseline"]:
            text += ("," if aside else "") + _speed_clause(lowest)
    fastest = max(fitting, key=lambda r: r["samples_per_s"] or 0)
    if fastest is not lowest and fastest is not base and fastest["samples_per_s"] and not fastest["speed_within_noise"]:
        text += f"; {fastest['strategy']} is the fastest ({charts.num(fastest['samples_per_s'])} samples/s)"
    repeats = [r for r in fitting if r is not base and r["strategy"] == base["strategy"] and r["speed_vs_baseline"]] \
        if base is not None else []  # fmt: skip
    for r in repeats:  # the same settings again (another trainer.seed): the noise itself
        text += f"; a repeat of {base['strategy']} ({r['_dir']}) runs at {speed_text(r)} its speed"
    return text + "."


def _speed_clause(row: dict[str, Any]) -> str:
    """The speed of the most saving point against its baseline, never claiming what noise could make."""
    if row["speed_within_noise"]:
        low, high = row["speed_vs_baseline_ci95_low"], row["speed_vs_baseline_ci95_high"]
        return f" at the same throughput within noise ({row['speed_vs_baseline']:.2f}x, interval {low:.2f}-{high:.2f})"
    return f" at {speed_text(row)} its throughput"


def _did_not_finish(members: list[dict[str, Any]]) -> str:
    """The points that did not finish, e.g. "ddp does not fit in 80 MiB at 1 or 2 ranks, oss
    at 1 rank; zero1 diverged at 4 ranks"."""
    clauses = []
    said_limit = None
    for status in ("oom", "failed", "diverged", "stopped"):
        where: dict[tuple, list[str]] = {}  # (world sizes, limit) -> strategies
        for name in dict.fromkeys(r["strategy"] for r in members):
            hit = [r for r in members if r["strategy"] == name and r["status"] == status]
            if hit:
                limits = {r["memory_limit_mib"] for r in hit}
                key = (tuple(sorted(r["world_size"] for r in hit)), limits.pop() if len(limits) == 1 else None)
                where.setdefault(key, []).append(name)
        parts = []
        for (sizes, limit), names in where.items():
            who = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            if not parts:
                verb = {"failed": "failed", "diverged": "diverged", "stopped": "was stopped"}.get(status)
                if status == "oom":
                    verb = ("does not fit" if len(names) == 1 else "do not fit") + limit_text(limit) if limit else (
                        "runs out of memory" if len(names) == 1 else "run out of memory")  # fmt: skip
                    said_limit = limit
                parts.append(f"{who} {verb} at {_ranks_list(list(sizes))}")
            else:  # the verb said once
                other = limit_text(limit) if status == "oom" and limit != said_limit else ""
                parts.append(f"{who}{other} at {_ranks_list(list(sizes))}")
        if parts:
            clauses.append(", ".join(parts))
    return "; ".join(clauses) + "." if clauses else ""


def headline(rows: list[dict[str, Any]]) -> str:
    """A few sentences computed from the sweep: per group of points that differ only in
    strategy and world size, what the most memory-saving strategy saves against the
    baseline at each world size and at what speed; what does not fit; how close the
    predictions came."""
    usable = [r for r in rows if r["world_size"]]
    swept = swept_of(rows)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in usable:
        groups.setdefault(row["_group"], []).append(row)
    varying = charts.series_keys(usable, swept) if usable else []
    sentences = []
    for members in groups.values():
        prefix = ", ".join(charts.series_label(members[0], varying).split(", ")[1:])
        said = [_at_world_size(ws, [r for r in members if r["world_size"] == ws])
                for ws in sorted({r["world_size"] for r in members})]  # fmt: skip
        text = " ".join([*said, _did_not_finish(members)]).strip()
        sentences.append((f"**{prefix}**: " if prefix and len(groups) > 1 else "") + text)
    bad = [r for r in rows if not r["world_size"]]
    if bad:
        sentences.append(f"{len(bad)} point(s) left no usable result.json ({', '.join(r['_dir'] for r in bad)}).")
    errors = [r for r in usable if _measured(r) and r["peak_rel_error_max"] is not None]
    if errors:
        worst = max(errors, key=lambda r: abs(r["peak_rel_error_max"]))
        off = [r for r in errors if abs(r["peak_rel_error_max"]) > charts.BAND]
        err = worst["peak_rel_error_max"]
        where = (
            f"{worst['strategy']} at {ranks(worst['world_size'])}, {err:+.1%}: {'too high' if err > 0 else 'too low'}"
        )
        if not off:
            sentences.append(
                f"Every rank's predicted peak is within {abs(err):.1%} of its measured one (largest: {where})."
            )
        else:
            sentences.append(f"At {len(off)} of {len(errors)} points that ran, a rank's predicted peak is more than "
                             f"{charts.BAND:.0%} off its measured one (worst: {where}).")  # fmt: skip
    return " ".join(sentences)


CHARTS = {
    "memory.png": ("Peak memory per rank vs world size", charts.memory_chart,
                   "measured peak per rank (solid) and its prediction (dashed) per strategy; a cross labelled OOM, "
                   "failed or diverged where a point did not finish, at its value when it ran out (what was live when "
                   "it crossed its budget, the dotted line) or else its prediction"),
    "throughput.png": ("Throughput vs world size", charts.throughput_chart,
                       "samples per second of all ranks (median step), its 95% interval as error bars; points without "
                       "a throughput are named in a box"),
    "breakdown.png": ("What each peak holds", charts.breakdown_chart,
                      "each point's peak split into parameters, gradients, optimizer state, activations and "
                      "temporaries: measured (left; CPU tracker; for a point that ran out of memory, what was live when it "
                      "crossed its budget, marked OOM) beside predicted (right, hatched; the fake step)"),
    "prediction.png": ("Predicted vs measured peak", charts.prediction_chart,
                       f"every rank of every point that ran, and (crosses) each point that ran out of memory at its "
                       f"value when it crossed its budget; the band is ±{charts.BAND:.0%}"),
}  # fmt: skip
"""The report's charts: file -> (title, function, what it shows)."""


def write_charts(rows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    """The four charts of :data:`CHARTS` in ``sweep_dir``, of the points that have a world
    size (an unreadable result.json has none). A chart that cannot be drawn is left out with
    a warning: the tables are written regardless."""
    rows = [r for r in rows if r.get("world_size")]
    if not rows:
        return []
    swept = swept_of(rows)
    written = []
    for name, (_, draw, _) in CHARTS.items():
        try:
            written.append(charts.save(draw(rows, swept), Path(sweep_dir) / name))
        except Exception as exc:  # noqa: BLE001 -- a chart is a view; report.md and the CSV still hold every figure
            print(f"warning: {name} not drawn ({type(exc).__name__}: {exc})", file=sys.stderr)
    return written


def _label(row: dict[str, Any]) -> str:
    return f"{row['strategy']} | {charts.ranks(row['world_size'])} | precision {row['precision']} | {row['model']}"


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
    # Bars only for the points that finished: a point that ran out of memory has no
    # throughput, and a bar of 0 would read as the slowest (report/table names it).
    speeds = wandb.Table(
        columns=["label", "samples_per_s"],
        data=[[_label(row), row["samples_per_s"]] for row in rows
              if row.get("status") == "ok" and row.get("samples_per_s") is not None],
    )  # fmt: skip
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
        import wandb

        # One report run per sweep directory: a fixed id, and an earlier local copy removed,
        # so that reporting again replaces the run instead of adding one.
        run_id = report_run_id(sweep_dir)
        for old in (Path(sweep_dir) / "wandb").glob(f"*-{run_id}"):
            shutil.rmtree(old, ignore_errors=True)
        run = init_wandb_run(
            cfg, job_type=REPORT_JOB_TYPE, name=report_run_name(sweep_dir), config=None, directory=str(sweep_dir),
            run_id=run_id,
        )  # fmt: skip
        run.log({**native_charts(rows, points), **{report_key(p.stem): wandb.Image(str(p)) for p in images}})
        run.finish()
    except Exception as exc:  # noqa: BLE001 -- the report files are written regardless
        print(f"warning: W&B summary run not written ({type(exc).__name__}: {exc})", file=sys.stderr)


def baseline_rule() -> str:
    return (
        "Memory in MiB per rank: the largest over ranks (`peak_allocated_mib_max`, what must fit) and the average "
        "over ranks (`peak_allocated_mib_mean`, the figure the seed study reported); `peak_saving_pct` (of the largest; "
        "`peak_mean_saving_pct`: of the average) and `speed_vs_baseline` compare each row "
        "with its `baseline`: the DDP point whose settings differ only in the strategy, or, where DDP did not run to "
        "the end, the least sharded point that fits at the same settings (in the order "
        + ", ".join(by_sharding(STRATEGIES.names()))
        + "). MFU is in percent (`mfu_pct`). Every column is in `report.csv` and at the end, named as in "
        "`result.json` and W&B."
    )


def speed_notes(rows: list[dict[str, Any]]) -> str:
    """Where the speed figures come from: the device, the threads each rank ran, the
    machine's load while each point was timed, and a warning where the load exceeded the
    cores (the steps then waited for other work: their speed is not the strategy's)."""
    timed = [r for r in rows if r.get("samples_per_s")]
    if not timed:
        return "Speed: no point was timed."
    where = []
    for r in timed:
        threads = f", {r['threads_per_rank']} thread(s) per rank" if r.get("threads_per_rank") else ""
        load = f", load {r['load_avg_1m']:.1f} on {r['cpu_count']} cores" if r.get("load_avg_1m") is not None else ""
        where.append(f"{r['_dir']} ({r['strategy']} x{r['world_size']}: {r.get('device') or '?'}{threads}{load}, "
                     f"{r.get('timed_steps') or 0} timed steps)")  # fmt: skip
    text = (
        "Speed: samples/s at the median step, with its 95% interval (order statistics); a ratio's interval "
        "is the two intervals' extremes, and a ratio whose interval holds 1.0 is within noise. On CPU the "
        "ranks share the cores: fewer ranks run more threads each. Points: " + "; ".join(where) + "."
    )
    few = [r for r in timed if r.get("min_timed_steps") and (r.get("timed_steps") or 0) < r["min_timed_steps"]]
    if few:
        text += ("\n\n**Few timed steps:** " +
                 ", ".join(f"{r['_dir']} ({r.get('timed_steps') or 0} of trainer.min_timed_steps={r['min_timed_steps']})"
                           for r in few) +
                 ": their intervals are wide, and a difference among them may read as within noise.")  # fmt: skip
    loaded = [r for r in timed if r.get("load_avg_1m") is not None and r.get("cpu_count")
              and r["load_avg_1m"] > r["cpu_count"]]  # fmt: skip
    if loaded:
        text += ("\n\n**Warning:** the machine's load exceeded its cores while " +
                 ", ".join(f"{r['_dir']} ({r['load_avg_1m']:.1f} on {r['cpu_count']})" for r in loaded) +
                 " ran: their speeds include waiting for other work.")  # fmt: skip
    return text


def report_markdown(rows: list[dict[str, Any]], name: str, note: str = "", drawn: set[str] | None = None) -> str:
    """report.md: the headline, the compact table, the charts (those in ``drawn``, by file
    name; None: all), then every column."""
    images = (
        "\n\n".join(
            f"![{title}]({file})\n\n*{title}*: {what}."
            for file, (title, _, what) in CHARTS.items()
            if drawn is None or file in drawn
        )
        or "No chart: no point has a usable result."
    )
    return (
        f"# Sweep report: {name}\n\n{headline(rows)}\n\n{compact(rows)}\n\n{baseline_rule()}{note}\n\n"
        f"{speed_notes(rows)}\n\n"
        f"## Charts\n\n{images}\n\n## Every column\n\n{markdown(rows)}\n"
    )


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    """report.md, report.csv, the charts and the W&B report run; nothing when the
    directory holds no result.json (returns the rows, empty then). The files are written in
    a staging directory beside them and moved into place together (:func:`publish_report`)."""
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
    import signal

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
