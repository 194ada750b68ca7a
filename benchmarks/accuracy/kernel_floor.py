"""A kernel's floor on the GPU: the device's time per tiny kernel launched back to back.

    python -m benchmarks.accuracy.kernel_floor            # on a machine with CUDA (scripts/device_round.sh runs it)
    python -m benchmarks.accuracy.kernel_floor --kernels 5000

On a GPU the time model prices an op at its roofline (its bytes or FLOPs over the device's
rate), launched ahead by the host (``launched_ahead`` in ``sharded_exp/predict/step_time.py``).
A step of many small ops also pays each kernel's fixed cost on the device (its launch on the
GPU, its blocks scheduled, its end), which no roofline counts; the stored GPU round's big
model is 12-24% short under that rule (``benchmarks.accuracy.gpu_repredict``), and this floor
is one candidate. Measured here for one-element in-place adds, ``--kernels`` of them, the best
of ``--repeats`` windows each (other work only slows a window):

- **graph**: captured in a CUDA graph and replayed (torch's ``torch.cuda.CUDAGraph``): no host
  work between the kernels, so the time per kernel is the device's own floor;
- **eager**: launched from Python back to back, timed by CUDA events: the larger of that floor
  and the host's cost per launch;
- **synchronised**: each followed by ``torch.cuda.synchronize()``, timed on the host: launch,
  floor and the round trip (what the ``this`` profile's lone-op overhead measures).

Prints the three, per kernel in microseconds, and writes outputs/benchmarks/kernel_floor.json.
Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.common import OUT, markdown, save


def _events_s(run, repeats: int) -> float:
    """The best of ``repeats`` timings of ``run()`` on the device, by CUDA events, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure(kernels: int, repeats: int) -> dict:
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()  # warm-up before capture on a side stream, as torch's CUDA graphs notes ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()

    def eager() -> None:
        for _ in range(kernels):
            x.add_(1)

    eager()
    torch.cuda.synchronize()
    graph_s = _events_s(graph.replay, repeats) / kernels
    eager_s = _events_s(eager, repeats) / kernels
    synced = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(200):
            x.add_(1)
            torch.cuda.synchronize()
        synced = min(synced, (time.perf_counter() - t0) / 200)
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "kernels": kernels,
            "graph_s": graph_s, "eager_s": eager_s, "synchronised_s": synced}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_floor needs CUDA: run it on a GPU machine (scripts/device_round.sh does)", file=sys.stderr)
        return 2
    found = measure(args.kernels, args.repeats)
    print(f"{found['device']}, torch {found['torch']}: {args.kernels} one-element adds, best of {args.repeats}")
    rows = [[way, f"{1e6 * found[key]:.2f}"] for way, key in
            (("graph (the device's floor)", "graph_s"), ("eager, back to back", "eager_s"),
             ("each synchronised", "synchronised_s"))]  # fmt: skip
    print(markdown(["launched", "us per kernel"], rows))
    print(f"wrote {save('kernel_floor', found)}")
    return 0


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    sys.exit(main())
