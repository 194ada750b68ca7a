"""The GPU check's step times predicted again, here, from what one GPU measured: a time-model
change checked against a GPU without one.

    python -m benchmarks.accuracy.gpu_repredict              # every stored job (18; about a minute)
    python -m benchmarks.accuracy.gpu_repredict --models small --precisions bf16

``benchmarks/accuracy/measured/`` keeps, from the last device round (``scripts/device_round.sh``
on one H200): the ``this`` profile measured on that GPU (``h200_this_profile.json``) and the
median step times of ``benchmarks.accuracy.gpu_check``'s jobs (``h200_step_medians.json``).
Each job is checked as a run on that GPU would check it (its fake CUDA step, world size 1,
priced by :func:`sharded_exp.predict.step_time.run_step_time`), with the stored profile read in
place of measuring this machine's GPU, and its prediction set beside the stored median, with
the signed error (below zero: predicted too short). No figure here is fitted: the profile is
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

MEASURED = Path(__file__).with_name("measured")


def stored() -> tuple[dict, dict]:
    """The stored medians and the ``this`` figures measured in the same round."""
    medians = json.loads((MEASURED / "h200_step_medians.json").read_text())
    rounds = json.loads((MEASURED / "h200_this_profile.json").read_text())[medians["profile_round"]]
    (figures,) = rounds.values()  # one key: that machine's
    return medians, figures


def predicted_ms(overrides: list[str], strategy: str, precision: str, figures: dict) -> tuple[float | None, str | None]:
    """A run's own step-time prediction for the job on the GPU whose ``this`` figures these
    are: the pre-flight a run makes on CUDA, its profile read from ``figures``."""
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
    return (None if step is None else 1e3 * step), speed.get("error")


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
                predicted, error = predicted_ms(case["overrides"], strategy, precision, figures)
                rel = None if predicted is None else (predicted - measured) / measured
                points.append({"model": model, "precision": precision, "strategy": strategy, "measured_ms": measured,
                               "predicted_ms": predicted, "error": rel, "why_none": error})  # fmt: skip
                rows.append([model, strategy, precision, f"{measured:.1f}", "-" if predicted is None else f"{predicted:.1f}",
                             "-" if rel is None else f"{rel:+.1%}"])  # fmt: skip
    errors = [abs(p["error"]) for p in points if p["error"] is not None]
    summary = {"points": len(points), "within_20pct": sum(e <= 0.2 for e in errors),
               "median_abs_error": statistics.median(errors) if errors else None}  # fmt: skip
    print(
        f"On {figures.get('device_name', '?')}'s stored this profile ({medians['profile_round']}), world size 1, batch {BATCH}"
    )
    print(markdown(["model", "strategy", "precision", "measured median ms", "predicted ms", "error"], rows))
    if errors:
        print(
            f"{summary['within_20pct']} of {len(errors)} within 20%; median |error| {summary['median_abs_error']:.1%}"
        )
    print(f"wrote {save('gpu_repredict', {'summary': summary, 'points': points})}")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
