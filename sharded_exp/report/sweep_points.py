"""The sweep's points: one ``result.json`` per point, read as far as it goes.

A sweep directory may hold points of an earlier sweep (a reused ``hydra.sweep.dir``) and
earlier attempts of a point (``attempts/``): neither is a point of this report. A point
that cannot be read still becomes a point, one that says why, so the report is written
either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sharded_exp.job.result import read_result

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


AS_COLUMNS = ("strategy", "trainer.world_size", "precision", "model")
"""Overrides that are report columns of their own."""


def overrides(point: dict[str, Any]) -> dict[str, str] | None:
    """A point's command-line overrides as {key: value} (``+``/``++`` dropped), from its
    result.json or, for an older one, its .hydra/overrides.yaml; None if unknown."""
    found = point.get("overrides")
    if found is None and point.get("output_dir"):
        try:
            found = yaml.safe_load((Path(point["output_dir"]) / ".hydra" / "overrides.yaml").read_text())
        except (OSError, ValueError):
            found = None
    if not isinstance(found, list):
        return None
    pairs = (str(o).lstrip("+").partition("=")[::2] for o in found)
    return {key: value.replace("'", "") for key, value in pairs}  # precision='32' as typed: 32


def point_name(point: dict[str, Any]) -> str:
    """A point as the report names it: ``point 3`` for a sweep's 3_<overrides>/, else its
    directory's name."""
    name = Path(point.get("output_dir") or "?").name
    number = name.split("_", 1)[0]
    return f"point {number}" if number.isdigit() else name


def swept_keys(points: list[dict[str, Any]]) -> list[str]:
    """Overrides whose value differs between points (beyond the report's own columns)."""
    known = [o for o in (overrides(p) for p in points) if o is not None]
    keys = dict.fromkeys(k for o in known for k in o)
    return [k for k in keys if k not in AS_COLUMNS and len({o.get(k) for o in known}) > 1]
