"""CPU offload's host optimizer step: its predicted time against a real step on this machine's CPU.

    python -m benchmarks.accuracy.host_step                  # 128M elements, 1 and 2 threads
    python -m benchmarks.accuracy.host_step --smoke          # CI: 2M elements, 1 thread

The time model prices an offloaded optimizer step as memory-bound: the bytes the configured
optimizer's own ops read and write per element (``host_step_bytes_per_element``, counted from
its ops) times the rank's elements, over the host's memory bandwidth: on a named GPU the
reference server's, shared by its ranks; on a GPU's ``this`` profile a copy of 1 GiB
(``measure_host_side``), larger than the CPU's cache as a shard's optimizer state is. Here
that copy is timed at the benchmark's threads, and the same optimizers step for real on fp32
CPU tensors (8 tensors, as a shard of several layers is, gradients set; 128M elements: 2 GiB
of parameters, gradients and AdamW's moments, beyond this VM's 300 MiB L3), built as a run
builds them for parameters on the CPU. Prints the median step (after two warm-ups) beside
the prediction, as a Markdown table, and writes outputs/benchmarks/host_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from benchmarks.common import markdown, save
from sharded_exp.config import OptimizerConfig
from sharded_exp.measure.machine import HOST_MEMORY_COPY_BYTES, measure_bandwidth
from sharded_exp.optim import optimizer_spec
from sharded_exp.predict.step_time import host_step_bytes_per_element

OPTIMIZERS = {
    "adamw": {"name": "adamw"},
    "adamw, weight decay 0.1": {"name": "adamw", "weight_decay": 0.1},
    "sgd, momentum 0.9": {"name": "sgd", "momentum": 0.9},
}
TENSORS = 8


def measured_step_s(settings: dict, elements: int, repeats: int) -> float:
    """The median seconds of a real step of ``settings``' optimizer over ``elements`` fp32 elements."""
    cfg = OmegaConf.structured(OptimizerConfig(**settings))
    model = torch.nn.Sequential(*(torch.nn.Linear(elements // TENSORS, 1, bias=False) for _ in range(TENSORS)))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer = optimizer_spec(cfg, model, torch.device("cpu")).build()
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        optimizer.step()
        if i >= 2:  # the first makes the state
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=128 * 2**20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="2M elements, 1 thread, 3 repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.elements, args.threads, args.repeats = 2 * 2**20, [1], 3
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        host_Bps = measure_bandwidth(0.5, HOST_MEMORY_COPY_BYTES) * 1e9
        for label, settings in OPTIMIZERS.items():
            per_element = host_step_bytes_per_element(OmegaConf.create({"optimizer": OptimizerConfig(**settings)}))
            predicted = per_element * args.elements / host_Bps
            measured = measured_step_s(settings, args.elements, args.repeats)
            rows.append({
                "optimizer": label, "threads": threads, "elements": args.elements,
                "bytes_per_element": per_element, "host_GBps": host_Bps / 1e9,
                "predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                "error_pct": 100 * (predicted - measured) / measured,
            })  # fmt: skip
    header = ["optimizer", "threads", "bytes/element", "host GB/s", "predicted ms", "measured ms", "error"]
    print(markdown(header, [[r["optimizer"], r["threads"], f"{r['bytes_per_element']:.0f}", f"{r['host_GBps']:.1f}",
                             f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}%"]
                            for r in rows]))  # fmt: skip
    save("host_step", {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
