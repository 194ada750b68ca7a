"""The GPU check's step times and peaks predicted again, here, from what one GPU measured: a
time-model or memory-model change checked against a GPU without one.

    python -m benchmarks.accuracy.gpu_repredict              # every stored job (18; about a minute)
    python -m benchmarks.accuracy.gpu_repredict --models small --precisions bf16

``benchmarks/accuracy/measured/`` keeps, from the last device round (``scripts/device_round.sh``
on one H200): the ``this`` profile measured on that GPU (``h200_this_profile.json``) and the
median step times and peak allocated and reserved memory of ``benchmarks.accuracy.gpu_check``'s
jobs (``h200_step_medians.json``).
Each job is checked as a run on that GPU would check it (its fake CUDA step, world size 1,
priced by :func:`sharded_exp.predict.step_time.run_step_time`), with the stored profile read in
place of measuring this machine's GPU, and its predictions set beside the stored figures, with
the signed errors (below zero: predicted too short or too small). That round ran torch 2.11:
run this under the same torch to predict as its pre-flight would have (a CUDA build imports
without a GPU; docs/development/benchmarks.md says how). No figure here is fitted: the profile is
the micro-benchmarks' and the medians are the runs'; the code at hand does the rest.

Prints a Markdown table and writes outputs/benchmarks/gpu_repredict.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from unittest import mock

from benchmarks.accuracy.gpu_check import BATCH
from benchmarks.common import OUT, markdown, save
from sharded_exp.compose import compose
from sharded_exp.launch import preflight
from sharded_exp.measure import machine
from sharded_exp.output.results import predicted_section

MEASURED = Path(__file__).with_name("measured")


def stored() -> tuple[dict, dict]:
    """The stored medians and the ``this`` figures measured in the same round."""
    medians = json.loads((MEASURED / "h200_step_medians.json").read_text())
    rounds = json.loads((MEASURED / "h200_this_profile.json").read_text())[medians["profile_round"]]
    (figures,) = rounds.values()  # one key: that machine's
    return medians, figures


def predicted(overrides: list[str], strategy: str, precision: str, figures: dict) -> dict:
    """A run's own predictions for the job on the GPU whose ``this`` figures these are: the
    pre-flight a run makes on CUDA, its profile read from ``figures``. Step time (ms, or None
    with why), and the peak allocated (the fake step's peak plus the allocator's rounding) and
    reserved (its allocations replayed through the allocator model), MiB, as the run's
    result.json states them."""
    cfg = compose([*overrides, f"strategy={strategy}", f"precision={precision}", f"trainer.batch_size={BATCH}",
                   "trainer.world_size=1", "logger=none"])  # fmt: skip
    # the stored GPU in place of this machine's (it has none): the device decided, the figures read
    with (
        mock.patch.object(machine, "this_figures", lambda *a, **k: figures),
        mock.patch.object(preflight, "decide_device", lambda *a, **k: "cuda"),
    ):
        spec = preflight.check(cfg, str(OUT / "gpu_repredict_run"))
    speed = spec.prediction["peak"].get("speed") or {}
    step = speed.get("step_time_s")
    memory = predicted_section(spec.prediction)
    rank = memory["per_rank"][0]
    extra = ((memory.get("peak_prediction") or {}).get("allocator") or {}).get("allocated_extra_mib")
    peak = rank.get("predicted_peak_mib")
    return {
        "step_ms": None if step is None else 1e3 * step,
        "why_none": speed.get("error"),
        "allocated_mib": None if peak is None or extra is None else peak + extra,
        "reserved_mib": rank.get("predicted_peak_reserved_mib"),
    }


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def main() -> None:
    medians, figures = stored()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(medians["models"]))
    parser.add_argument("--precisions", nargs="+", default=None, help="default: every stored precision")
    args = parser.parse_args()
    rows, points = [], []
    for model in args.models:
        case = medians["models"][model]
        for precision, by_strategy in case["median_ms"].items():
            if args.precisions and precision not in args.precisions:
                continue
            for strategy, measured in by_strategy.items():
                guess = predicted(case["overrides"], strategy, precision, figures)
                allocated, reserved = case.get("peak_mib", {}).get(precision, {}).get(strategy) or (None, None)
                point = {"model": model, "precision": precision, "strategy": strategy, "measured_ms": measured,
                         "predicted_ms": guess["step_ms"], "error": _rel(guess["step_ms"], measured),
                         "why_none": guess["why_none"],
                         "peak_allocated_mib": allocated, "predicted_allocated_mib": guess["allocated_mib"],
                         "allocated_error": _rel(guess["allocated_mib"], allocated),
                         "peak_reserved_mib": reserved, "predicted_reserved_mib": guess["reserved_mib"],
                         "reserved_error": _rel(guess["reserved_mib"], reserved)}  # fmt: skip
                points.append(point)
                rows.append([model, strategy, precision, f"{measured:.1f}", _num(point["predicted_ms"], ".1f"),
                             _num(point["error"], "+.1%"), _num(allocated, ".1f"), _num(point["predicted_allocated_mib"], ".1f"),
                             _num(point["allocated_error"], "+.1%"), _num(reserved, ".0f"),
                             _num(point["predicted_reserved_mib"], ".0f"), _num(point["reserved_error"], "+.1%")])  # fmt: skip
    errors = [abs(p["error"]) for p in points if p["error"] is not None]
    summary = {"points": len(points), "within_20pct": sum(e <= 0.2 for e in errors),
               "median_abs_error": statistics.median(errors) if errors else None}  # fmt: skip
    print(
        f"On {figures.get('device_name', '?')}'s stored this profile ({medians['profile_round']}), world size 1, batch {BATCH}"
    )
    print(markdown(["model", "strategy", "precision", "measured median ms", "predicted ms", "error",
                    "peak allocated MiB", "predicted", "error", "peak reserved MiB", "predicted", "error"], rows))  # fmt: skip
    if errors:
        print(
            f"{summary['within_20pct']} of {len(errors)} within 20%; median |error| {summary['median_abs_error']:.1%}"
        )
    for key in ("allocated", "reserved"):
        off = [abs(p[f"{key}_error"]) for p in points if p[f"{key}_error"] is not None]
        summary[f"{key}_within_3pct"] = sum(e <= 0.03 for e in off)
        if off:
            print(
                f"peak {key}: {summary[f'{key}_within_3pct']} of {len(off)} within 3%; largest |error| {max(off):.1%}"
            )
    print(f"wrote {save('gpu_repredict', {'summary': summary, 'points': points})}")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
