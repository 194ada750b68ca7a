"""A run's predicted step time beside its measured one: result.json's ``throughput`` figures.

Plain numbers in and out, so the training loop reads them without the prediction's imports.
"""

from __future__ import annotations

from typing import Any


def step_time_figures(speed: dict[str, Any] | None, measured_s: float | None) -> dict[str, Any]:
    """``predicted_step_time_s``, ``step_time_rel_error`` ((predicted - measured) / measured,
    as memory's ``peak_rel_error``) and ``step_time_prediction`` (the prediction's parts, or
    the error that left it null) from the parent's prediction ``speed``
    (:func:`sharded_exp.predict.step_time.run_step_time`) and the measured median step."""
    speed = speed or {"step_time_s": None, "error": "no step time was predicted (no fake step)"}
    predicted = speed.get("step_time_s")
    error = (predicted - measured_s) / measured_s if predicted is not None and measured_s else None
    parts = {k: v for k, v in speed.items() if k != "step_time_s"}
    return {"predicted_step_time_s": predicted, "step_time_rel_error": error, "step_time_prediction": parts}
