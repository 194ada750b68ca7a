"""Hand-written sweep points (result.json dicts) for the unit tests of the sweep report
(tests/unit/report/): only the fields a row reads, values chosen
so that every saving, ratio and interval can be worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sharded_exp.report.rows import build_rows


def point(
    strategy: str,
    world_size: int = 2,
    *,
    n: int = 0,
    status: str = "ok",
    peak: float | None = None,
    mean: float | None = None,
    states: float | None = None,
    predicted: float | None = None,
    rel_error: float | None = None,
    sps: float | None = None,
    ci: tuple[float, float] | None = None,
    l2: float | None = None,
    precision: str = "32",
    model: str = "mlp",
    overrides: list[str] | None = None,
    limit: float | None = None,
    timed_steps: int | None = None,
    min_timed_steps: int | None = None,
    load: float | None = None,
    cpus: int | None = None,
    sweep_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One point of a sweep, in result.json's shape; ``n`` its number in the sweep
    (its directory ``/sweep/<n>_strategy=<strategy>``: the report names it ``point <n>``)."""
    memory: dict[str, Any] = {}
    if peak is not None:
        memory["peak_allocated_mib_max"] = peak
        memory["peak_allocated_mib_mean"] = peak if mean is None else mean
    if states is not None:
        memory["model_states_mib_max"] = states
    if predicted is not None:
        memory["predicted_peak_mib_max"] = predicted
    if rel_error is not None:
        memory["peak_rel_error_max"] = rel_error
    throughput: dict[str, Any] = {}
    if sps is not None:
        throughput["samples_per_s"] = sps
    if ci is not None:
        throughput["samples_per_s_ci95_low"], throughput["samples_per_s_ci95_high"] = ci
    if timed_steps is not None:
        throughput["timed_steps"] = timed_steps
    if load is not None:
        throughput["load_avg_1m"], throughput["cpu_count"] = load, cpus
    data: dict[str, Any] = {
        "status": status,
        "error": None,
        "strategy": strategy,
        "world_size": world_size,
        "precision": precision,
        "model": model,
        "output_dir": f"/sweep/{n}_strategy={strategy}",
        "overrides": overrides if overrides is not None else [f"strategy={strategy}"],
        "memory": memory,
        "throughput": throughput or None,
        "config": {"trainer": {"memory_limit_mib": limit, "min_timed_steps": min_timed_steps}},
    }
    if l2 is not None:
        data["param_digest"] = {"l2": l2}
    if sweep_id is not None:
        data["sweep_id"] = sweep_id
    data.update(extra)
    return data


def write_point(sweep: Path, name: str, data: Any) -> Path:
    """``data`` as ``<sweep>/<name>/result.json`` (``data`` a dict, or text written as is)."""
    directory = sweep / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "result.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def rows_by(rows, *keys):
    """The report's rows by the value of ``keys`` (a tuple of them when more than one)."""
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


def pair(ddp=None, fsdp=None):
    """DDP (point 1: 4 MiB, 10 samples/s in 8-12) and FSDP (point 2: 1 MiB, 5 samples/s in 4-6)."""
    a = {"n": 1, "peak": 4.0, "mean": 3.0, "states": 2.0, "sps": 10.0, "ci": (8.0, 12.0), "l2": 2.0, **(ddp or {})}
    b = {"n": 2, "peak": 1.0, "mean": 0.75, "states": 0.5, "sps": 5.0, "ci": (4.0, 6.0), "l2": 2.002, **(fsdp or {})}
    return build_rows([point("ddp", **a), point("fsdp", **b)])
