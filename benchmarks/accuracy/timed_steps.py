"""How many timed steps a stable median needs: the default of ``trainer.min_timed_steps``.

    python -m benchmarks.accuracy.timed_steps                        # mlp and gpt, ddp and fsdp, 2 ranks, 80 timed steps
    python -m benchmarks.accuracy.timed_steps --timed 30 --models mlp   # smoke

Each job runs its model's default shape on 2 ranks (W&B off) and times ``--timed`` steps
after warm-up. Its step times are cut into consecutive windows of n steps; in each window
the median's 95% interval (order statistics, ``sharded_exp.train.metrics.median_ci95``, what
every run reports) is taken, and its half-width relative to the median. The table gives,
per job and n, the median of that relative half-width over the windows. The smallest n
whose half-width is within ``--target`` (5%) for every job is the recommended default:
with it, two strategies whose speeds differ by more than about twice the target read as
different, and closer ones as within noise. Run it on a quiet machine and on a shared one:
the load widens the intervals (the machine's 1-minute load average is printed beside).
Writes outputs/benchmarks/timed_steps.json.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.common import markdown, run, save
from sharded_exp.train.metrics import median_ci95

WINDOWS = (6, 8, 10, 15, 20, 30, 40, 60, 80)


def half_widths(times: list[float], n: int) -> list[float]:
    """The median's 95% interval's half-width, relative to the median, in each window of n steps."""
    out = []
    for start in range(0, len(times) - n + 1, n):
        window = times[start : start + n]
        low, high = median_ci95(window)
        out.append((high - low) / 2 / statistics.median(window))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--timed", type=int, default=80, help="steps timed after warm-up")
    parser.add_argument("--target", type=float, default=0.05, help="relative half-width of the median's interval")
    args = parser.parse_args()
    warmup = 5
    rows, data = [], {"target": args.target, "timed": args.timed, "jobs": []}
    enough: list[int | None] = []
    for model in args.models:
        for strategy in args.strategies:
            overrides = [f"model={model}", f"strategy={strategy}", "trainer.world_size=2", "logger=none",
                         f"trainer.steps={warmup + args.timed}", f"trainer.warmup_steps={warmup}",
                         "trainer.eval_batches=0", "trainer.progress_bar=false"]  # fmt: skip
            load_before = os.getloadavg()[0]
            result = run(overrides, f"timed_steps/{model}_{strategy}")
            times = result["throughput"]["step_times_s"]
            by_n = {n: statistics.median(half_widths(times, n)) for n in WINDOWS if n <= len(times)}
            first = next((n for n, w in by_n.items() if w <= args.target), None)
            enough.append(first)
            data["jobs"].append({"model": model, "strategy": strategy, "half_width_by_n": by_n, "enough": first,
                                 "step_time_s_median": statistics.median(times), "load_avg_1m": load_before})  # fmt: skip
            rows.append([f"{model}/{strategy}", f"{statistics.median(times) * 1e3:.1f} ms", f"{load_before:.1f}",
                         *(f"{100 * by_n[n]:.1f}%" if n in by_n else "" for n in WINDOWS), first or f"> {args.timed}"])  # fmt: skip
    print(markdown(["job", "median step", "load", *(f"n={n}" for n in WINDOWS), "enough"], rows))
    known = [n for n in enough if n is not None]
    data["recommended"] = max(known) if len(known) == len(enough) else None
    print(f"\nrecommended trainer.min_timed_steps: {data['recommended'] or f'more than {args.timed}'} "
          f"(the median's 95% interval within +-{100 * args.target:.0f}% for every job)")  # fmt: skip
    print(f"wrote {save('timed_steps', data)}")


if __name__ == "__main__":
    main()
