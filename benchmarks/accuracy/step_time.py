"""Predicted against measured step time on this machine's CPU, every strategy at 1 and 2 ranks.

    python -m benchmarks.accuracy.step_time            # gpt and hf_gpt2, two sizes each
    python -m benchmarks.accuracy.step_time --quick    # gpt, the smaller size only

Each job is a real run (``python -m sharded_exp``'s launcher, gloo ranks, the cores shared
out as a run shares them); its result.json holds the time model's prediction
(``throughput.predicted_step_time_s``, from the run's own fake step priced on the ``this``
profile) beside the measured median and its 95% interval. Prints a Markdown table with the
error of each, then, at 2 ranks, whether the predicted order of strategies by speed agrees
with the measured one wherever the measured intervals do not overlap. Writes
outputs/benchmarks/step_time.json. The issue's target: within 20% of the measured median.
The ``this`` profile is measured again first (``--cached`` keeps the cached one), for the
threads a rank gets at 1 and at 2 ranks: the prediction and the runs then see the machine in
the same hour. Warning: a machine whose pace changes (a shared VM's neighbours) moves the
measurement, not the prediction; each row says the 1-minute load when its timed steps ran.
"""

from __future__ import annotations

import argparse
import itertools

from benchmarks.common import markdown, run, save, strategy_names

MODELS = {
    "gpt small": ["model=gpt"],
    "gpt wide": ["model=gpt", "model.d_model=256", "model.n_layers=4"],
    "hf_gpt2 small": ["model=hf_gpt2"],
    "hf_gpt2 wide": ["model=hf_gpt2", "model.config.n_embd=256", "model.config.n_layer=4"],
}
"""Two sizes of each model (the presets' own, and wider and deeper)."""


def measure(model: str, overrides: list[str], strategy: str, world_size: int, steps: int) -> dict:
    name = f"{model.replace(' ', '_')}_{strategy}_x{world_size}"
    result = run([*overrides, f"strategy={strategy}", f"trainer.world_size={world_size}", f"trainer.steps={steps}",
                  "logger=none"], name, check=False)  # fmt: skip
    tp = result.get("throughput") or {}
    return {"model": model, "strategy": strategy, "world_size": world_size, "status": result["status"],
            "load": tp.get("load_avg_1m"),
            "measured_s": tp.get("step_time_s_median"), "low_s": tp.get("step_time_s_ci95_low"),
            "high_s": tp.get("step_time_s_ci95_high"), "predicted_s": tp.get("predicted_step_time_s"),
            "error": tp.get("step_time_rel_error"),
            "why": (tp.get("step_time_prediction") or {}).get("error")}  # fmt: skip


def order_agrees(rows: list[dict]) -> list[str]:
    """Pairs at 2 ranks whose measured intervals do not overlap and whose predicted order differs."""
    wrong = []
    for a, b in itertools.combinations([r for r in rows if r["world_size"] == 2 and r["predicted_s"]], 2):
        if a["model"] != b["model"] or None in (a["low_s"], a["high_s"], b["low_s"], b["high_s"]):
            continue
        if a["high_s"] < b["low_s"] or b["high_s"] < a["low_s"]:
            if (a["measured_s"] < b["measured_s"]) != (a["predicted_s"] < b["predicted_s"]):
                wrong.append(f"{a['model']}: {a['strategy']} vs {b['strategy']}")
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt, the smaller size only")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="these models only (default: all)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cached", action="store_true", help="keep the cached this profile (default: measure again)")
    args = parser.parse_args()
    if not args.cached:
        from sharded_exp.measure.machine import this_figures
        from sharded_exp.plan.speed import threads_per_rank

        for world_size in (1, 2):
            found = this_figures(threads_per_rank(world_size), remeasure=True)
            print(
                f"this profile at {threads_per_rank(world_size)} thread(s): copy {found['memory_bandwidth_GBps']:.1f} GB/s, "
                f"host cost per forward/backward op {1e6 * found['step_op_overhead_s']['fp32']:.1f} us, "
                f"per optimizer op {1e6 * (found.get('optimizer_op_overhead_s') or float('nan')):.1f} us "
                f"(FSDP2 {1e6 * found['sharded_step_op_overhead_s'].get('fp32', float('nan')):.1f} and "
                f"{1e6 * (found.get('sharded_optimizer_op_overhead_s') or float('nan')):.1f} us), "
                f"a new page {1e6 * found.get('fresh_page_s', float('nan')):.2f} us"
            )
    names = ["gpt small"] if args.quick else (args.models or list(MODELS))
    models = {name: MODELS[name] for name in names}
    rows = [measure(m, o, s, ws, args.steps) for m, o in models.items() for s in strategy_names() for ws in (1, 2)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    table = [[r["model"], r["strategy"], r["world_size"], fmt(r["measured_s"] and 1000 * r["measured_s"], ".1f"),
              fmt(r["predicted_s"] and 1000 * r["predicted_s"], ".1f"), fmt(r["error"] and 100 * r["error"], "+.0f"),
              fmt(r["load"], ".1f"), r["why"] or r["status"]] for r in rows]  # fmt: skip
    print(markdown(["model", "strategy", "ranks", "measured ms", "predicted ms", "error %", "load", "note"], table))
    within = [r for r in rows if r["error"] is not None and abs(r["error"]) <= 0.2]
    print(f"\nwithin 20%: {len(within)} of {sum(r['error'] is not None for r in rows)}")
    wrong = order_agrees(rows)
    print("order at 2 ranks where the measured intervals separate: " + ("; ".join(wrong) or "right everywhere"))
    save("step_time", {"rows": rows, "order_wrong": wrong})


if __name__ == "__main__":
    main()
