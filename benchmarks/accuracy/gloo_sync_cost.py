"""What a gloo collective costs between two busy CPU ranks, against the ``this`` profile's figure.

    python -m benchmarks.accuracy.gloo_sync_cost             # 3 rounds, work of 0.5, 2 and 8 ms
    python -m benchmarks.accuracy.gloo_sync_cost --smoke     # CI: one round, short loops

The ``this`` profile's link latency is a 1 KiB all-reduce's time in the fastest window of
back-to-back calls (``sharded_exp/measure/machine.py::LATENCY_ELEMENTS``: one float never
travels both ways in gloo's ring). A training step calls its collectives between compute
instead. Two ranks (one thread each, as a 2-rank run on 2 cores has) each do a fixed amount of
work (128 x 128 matmuls, about W ms), then that all-reduce, ``--calls`` times; the same loop without
the all-reduce is timed beside it. The difference per call is what a collective costs after W
ms of compute: its latency, and the wait for the rank that fell behind while both computed.
Also timed: 29 broadcasts of a 2-block GPT's parameter shapes (``model=gpt``'s) issued at once
then waited, as ZeroRedundancyOptimizer sends its updated parameters, against the same issued
one at a time. Medians over ``--rounds`` rounds, rank 0's clock. Prints a Markdown table and
writes outputs/benchmarks/gloo_sync_cost.json. No figure here enters the time model.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import markdown, save, spawn_ranks
from sharded_exp.compose import compose
from sharded_exp.measure.machine import LATENCY_ELEMENTS
from sharded_exp.models import build_model


def gpt_shapes() -> list[tuple[int, ...]]:
    """``model=gpt``'s parameter shapes (29 tensors at its defaults), from the model itself."""
    return [tuple(p.shape) for p in build_model(compose(["model=gpt"]).model).parameters()]


def _ranks(rank: int, world_size: int, works_ms: list[float], calls: int, rounds: int, shapes: list) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    a, small = torch.randn(128, 128), torch.ones(LATENCY_ELEMENTS)  # the profile's latency call

    def work(n: int) -> None:
        for _ in range(n):
            a @ a

    start = time.perf_counter()
    work(500)
    per_matmul = (time.perf_counter() - start) / 500

    def timed(fn, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    rows = []
    for ms in works_ms:
        n = max(1, round(ms / 1000 / per_matmul))
        alone, synced = [], []
        for _ in range(rounds):
            alone.append(timed(lambda: work(n), calls))
            synced.append(timed(lambda: (work(n), dist.all_reduce(small)), calls))
        rows.append({"work_ms": 1000 * statistics.median(alone),
                     "cost_per_call_ms": 1000 * (statistics.median(synced) - statistics.median(alone))})  # fmt: skip
    back_to_back = min(timed(lambda: dist.all_reduce(small), calls) for _ in range(rounds))
    tensors = [torch.ones(shape) for shape in shapes]

    def at_once() -> None:
        for handle in [dist.broadcast(t, i % world_size, async_op=True) for i, t in enumerate(tensors)]:
            handle.wait()

    def one_by_one() -> None:
        for i, t in enumerate(tensors):
            dist.broadcast(t, i % world_size)

    per = len(tensors)
    return {
        "tensors": per,
        "rows": rows,
        "back_to_back_ms": 1000 * back_to_back,
        "broadcasts_at_once_ms": 1000 * statistics.median(timed(at_once, calls // 4 or 1) for _ in range(rounds)) / per,
        "broadcasts_one_by_one_ms": 1000
        * statistics.median(timed(one_by_one, calls // 4 or 1) for _ in range(rounds))
        / per,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-ms", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round of 8 calls after 0.5 ms of work")
    args = parser.parse_args()
    works, calls, rounds = ([0.5], 8, 1) if args.smoke else (args.work_ms, args.calls, args.rounds)
    found = spawn_ranks(_ranks, 2, works, calls, rounds, gpt_shapes())
    table = [[f"{r['work_ms']:.2f}", f"{r['cost_per_call_ms']:.3f}"] for r in found["rows"]]
    print(f"An all-reduce of {LATENCY_ELEMENTS} floats between 2 gloo ranks, 1 thread each, after W ms of work:")
    print(markdown(["work between calls W (ms)", "cost per call (ms)"], table))
    print(
        f"\nback to back (the this profile's kind of figure, fastest window): {found['back_to_back_ms']:.3f} ms a call"
    )
    print(f"{found['tensors']} broadcasts issued at once then waited: {found['broadcasts_at_once_ms']:.3f} ms each; "
          f"one after the other: {found['broadcasts_one_by_one_ms']:.3f} ms each")  # fmt: skip
    print(f"wrote {save('gloo_sync_cost', {'args': vars(args), **found})}")


if __name__ == "__main__":
    main()
