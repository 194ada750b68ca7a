"""One row per point, compared with its baseline.

A row holds a point's figures under the report's column names (:data:`COLUMNS`: the names
of result.json and W&B), the swept overrides, and the comparison with its baseline: the DDP
point whose settings differ only in the strategy, else the least sharded point that fits
(:func:`build_rows`).
"""

from __future__ import annotations

import math
from typing import Any

from sharded_exp.report.statistics import mean_over_ranks, speed_interval
from sharded_exp.report.sweep_points import overrides, point_name, swept_keys
from sharded_exp.strategies import baseline, sharding_order

COLUMNS = [
    "strategy",
    "world_size",
    "precision",
    "model",
    "params",
    "peak_allocated_mib_max",
    "peak_allocated_mib_mean",
    "predicted_peak_mib_max",
    "predicted_peak_mib_mean",
    "peak_rel_error_max",
    "model_states_mib_max",
    "predicted_model_states_mib_max",
    "memory_limit_mib",
    "peak_saving_pct",
    "peak_mean_saving_pct",
    "states_saving_pct",
    "samples_per_s",
    "samples_per_s_ci95_low",
    "samples_per_s_ci95_high",
    "speed_vs_baseline",
    "speed_vs_baseline_ci95_low",
    "speed_vs_baseline_ci95_high",
    "speed_within_noise",
    "timed_steps",
    "device",
    "threads_per_rank",
    "load_avg_1m",
    "cpu_count",
    "mfu_pct",
    "final_loss",
    "eval/accuracy",
    "eval/f1",
    "eval/perplexity",
    "parity_vs_baseline",
    "status",
    "first_nonfinite_step",
    "error",
    "oom_breakdown",
]
"""Every column of report.csv and the full table (the swept overrides follow ``model``,
``baseline`` comes last)."""
REPEATS = ("trainer.seed",)
"""Overrides that repeat a point rather than change it: points that differ only in them are
compared with each other (the first one is the baseline), as a measure of the noise."""


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


def point_row(r: dict[str, Any]) -> dict[str, Any]:
    """A point's figures under the report's column names (placeholders where it has none),
    and, not as columns, what the charts need: each rank's figures and the prediction's split."""
    mem = r.get("memory") or {}
    tp = r.get("throughput") or {}
    return {
        "strategy": r.get("strategy", "?"),
        "world_size": r.get("world_size") or 0,  # null: no usable world size (an incomplete point)
        "precision": str(r.get("precision", "?")),
        "model": r.get("model", "?"),
        "params": r.get("params"),
        "peak_allocated_mib_max": mem.get("peak_allocated_mib_max"),
        "peak_allocated_mib_mean": mean_over_ranks(mem, "peak_allocated_mib"),
        "predicted_peak_mib_mean": mean_over_ranks(mem, "predicted_peak_mib"),
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
        "device_name": (r.get("device") or {}).get("name"),  # not a column: the headline names a GPU by it
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


def measured(row: dict[str, Any]) -> bool:
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
    points whose settings differ only in the strategy (same model and size, precision, world
    size and every other swept override); ``baseline`` says which point that is, or why none."""
    swept = swept_keys(points)
    rows = []
    for point in points:
        row = point_row(point)
        found = overrides(point) or {}
        for k in swept:
            row[k] = found.get(k)
        row["_dir"] = point_name(point)
        # the model is its name and its size: two models of one class (a probe names its class)
        # are different settings, not repeats
        row["_group"] = (row["model"], str(row["params"]), row["precision"],
                         *(str(row[k]) for k in swept if k not in REPEATS))  # fmt: skip
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
    for col, metric in (
        ("peak_saving_pct", "peak_allocated_mib_max"),
        ("peak_mean_saving_pct", "peak_allocated_mib_mean"),
        ("states_saving_pct", "model_states_mib_max"),
    ):
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


def swept_of(rows: list[dict[str, Any]]) -> list[str]:
    """The swept overrides that are columns of their own (keys of the rows)."""
    known = (
        set(COLUMNS)
        | set(point_row({}))
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


def series_keys(rows: list[dict[str, Any]], swept: list[str]) -> list[str]:
    """What tells two lines of a chart apart besides the strategy: the swept overrides
    (levers among them) and the model and precision when they vary (the model's size where
    one model name has two)."""
    varying = [k for k in ("model", "precision") if len({r[k] for r in rows}) > 1]
    settings = lambda r: (r["model"], *(str(r.get(k)) for k in swept))  # noqa: E731
    if len({(*settings(r), r.get("params")) for r in rows}) > len({settings(r) for r in rows}):
        varying.insert(0, "params")  # one model name at two sizes that no swept setting tells apart
    return varying + list(swept)


def series_label(row: dict[str, Any], keys: list[str]) -> str:
    """A row's series as a chart's legend and the headline name it: ``fsdp, precision 16, activation_checkpointing=full``."""
    parts = [row["strategy"]]
    for k in keys:
        short = k.split(".")[-1]  # activation_checkpointing=full, not trainer.activation_checkpointing=full
        if k == "params":
            parts.append(f"{row['model']} of {row[k]:,} parameters" if row[k] is not None else row["model"])
            continue
        parts.append(f"precision {row[k]}" if k == "precision" else row[k] if k == "model" else f"{short}={row[k]}")
    return ", ".join(str(p) for p in parts)
