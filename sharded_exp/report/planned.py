"""The speed a sweep's CPU points would have on a named GPU (``report.device_profile``),
priced by the planner, for the headline to put beside the measured one.

A CPU sweep's speed ratios come from gloo on shared cores; on GPUs with NVLink the same
strategies compare quite differently. For each point that ran on the CPU, the planner's own
functions (:mod:`sharded_exp.plan.speed`) price the point's config at its world size on the
profile: one traced fake step per distinct config (the points of several world sizes share
it), then the strategy's time model on the profile's links. Nothing here fails the report:
a point that cannot be priced gets the reason instead (``row["_planned"]["note"]``).
"""

from __future__ import annotations

import json
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.config import PlanConfig
from sharded_exp.report.sweep_points import point_name

GROUPS = ("strategy", "precision", "model", "optimizer", "data", "trainer")
"""The parts of a point's config the planner reads (those it shares with a training job)."""


def profile_of(points: list[dict[str, Any]]) -> str | None:
    """The sweep's ``report.device_profile``, read from its points' configs (the first one
    named: a sweep sets it once for all its points)."""
    for p in points:
        name = (((p.get("config") or {}).get("report")) or {}).get("device_profile")
        if name:
            return str(name)
    return None


def plan_config(config: dict[str, Any], profile: str):
    """A point's resolved config as the planner's config, planned for ``profile`` (CUDA's kernels)."""
    groups = {k: config[k] for k in GROUPS if k in config}
    return OmegaConf.merge(
        OmegaConf.structured(PlanConfig), groups, {"plan": {"device": "cuda", "device_profile": profile}}
    )


def add_planned(rows: list[dict[str, Any]], points: list[dict[str, Any]], profile: str | None = None) -> None:
    """``row["_planned"] = {"profile", "step_time_s", "note"}`` for each row whose point ran on
    the CPU to its end, when the sweep names a profile (``profile``, else the points'
    ``report.device_profile``); nothing when it names none."""
    profile = profile or profile_of(points)
    if not profile:
        return
    by_name = {point_name(p): p for p in points}
    traces: dict[str, dict[str, Any]] = {}
    for row in rows:
        point = by_name.get(row["_dir"])
        if point is None or row["status"] != "ok":
            continue
        if row["device"] != "cpu":
            row["_planned"] = {"profile": profile, "step_time_s": None, "note": "it ran on a GPU"}
            continue
        row["_planned"] = {"profile": profile, **_priced(point, profile, traces)}


def _priced(point: dict[str, Any], profile: str, traces: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The point's planned step time on ``profile``, or the reason there is none (one line)."""
    config, world_size = point.get("config") or {}, int(point.get("world_size") or 0)
    missing = [k for k in GROUPS if k not in config]
    if missing or world_size < 1:
        return {"step_time_s": None, "note": f"its result.json has no {', '.join(missing) or 'world size'}"}
    try:
        # lazy: the planner imports torch, which every job's Hydra callback (this module's importer) would pay
        from sharded_exp.plan.depth import shapes_of
        from sharded_exp.plan.points import _layer_key
        from sharded_exp.plan.speed import speed_columns, traced
        from sharded_exp.precision import Precision
        from sharded_exp.predict.prediction import predict

        cfg = plan_config(config, profile)
        key = json.dumps({k: config[k] for k in GROUPS}, sort_keys=True, default=str)
        if key not in traces:  # the same config at another world size: the same trace
            traces[key] = traced(cfg, "cuda", _layer_key(cfg.model))
        shapes = shapes_of(cfg)
        prediction = predict(cfg.strategy, cfg.optimizer, str(Precision.of(cfg)), shapes, world_size)
        columns = speed_columns(cfg, world_size, traces[key], prediction)
    except Exception as exc:  # noqa: BLE001 -- measuring never breaks the report: the reason instead
        return {
            "step_time_s": None,
            "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
        }
    step = columns.get("step_time_s")
    return {"step_time_s": step, "note": None if step else (columns.get("speed_note") or "no step time planned")}
