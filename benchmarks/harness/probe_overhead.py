"""What the probe costs a user's step: the same loop probed and unprobed, alternating, in one process.

    python -m benchmarks.harness.probe_overhead                 # examples/plain_loop_probe.py's model, 5 runs
    python -m benchmarks.harness.probe_overhead --pairs 2 --steps 20   # a smoke run

Each run holds two copies of the loop from the same seed, one bare and one inside
``probe(...)`` with ``p.step(loss)`` after every optimizer step, and steps them in turn, so each
probed step has a bare neighbour under the same machine load. Every step is timed by the
benchmark itself (``perf_counter`` around the whole iteration, the probe's call included),
from the step after the probe's window (warm-up 5, tracked 2, on CPU). A run's overhead is the
median over steps of probed / bare - 1; the target is at most 3% (the median over runs). Writes outputs/benchmarks/probe_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import markdown, save
from examples import plain_loop_probe as ex
from sharded_exp.probe import probe

SKIP = 7  # the probe's warm-up (5) and tracked (2) steps: neither side's timed figure


def one(steps: int, run_dir: str) -> tuple[list[float], list[float]]:
    """Two copies of the loop, stepped in turn (bare, probed, bare, probed, ...): every timed
    step of one has a neighbour of the other under the same load. Their step times."""

    def loop():
        torch.manual_seed(0)
        model = ex.build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = ex.batches(0, 32, torch.device("cpu"))
        return model, optimizer, data, next(data)

    bare, probed = loop(), loop()
    p = probe(probed[0], probed[1], run_dir, samples_per_step=32, example=probed[3], step_fn=ex.step_fn)
    times: dict[str, list[float]] = {"bare": [], "probed": []}
    for _ in range(steps):
        for name, (model, optimizer, data, batch) in (("bare", bare), ("probed", probed)):
            t0 = time.perf_counter()
            loss = ex.step_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if name == "probed":
                p.step(loss)
            times[name].append(time.perf_counter() - t0)
    p.close()
    return times["bare"][SKIP:], times["probed"][SKIP:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5, help="runs")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            bare, probed = one(args.steps, f"{tmp}/{i}")
            ratios = [b / a for a, b in zip(bare, probed)]  # neighbouring steps: the same load
            pairs.append({"bare_s": statistics.median(bare), "probed_s": statistics.median(probed),
                          "overhead": statistics.median(ratios) - 1})  # fmt: skip
    overhead = statistics.median(p["overhead"] for p in pairs)
    rows = [[i, f"{p['bare_s'] * 1e3:.3f}", f"{p['probed_s'] * 1e3:.3f}", f"{p['overhead'] * 100:+.2f}%"]
            for i, p in enumerate(pairs)]  # fmt: skip
    print(markdown(["run", "bare step (ms, median)", "probed step (ms, median)", "overhead (median of step ratios)"], rows))
    print(f"\nmedian overhead over {len(pairs)} runs: {overhead * 100:+.2f}% (target: <= 3%), "
          f"{args.steps - SKIP} timed steps per run, {torch.get_num_threads()} threads")  # fmt: skip
    save("probe_overhead", {"pairs": pairs, "median_overhead": overhead, "steps": args.steps,
                            "threads": torch.get_num_threads()})  # fmt: skip


if __name__ == "__main__":
    main()
