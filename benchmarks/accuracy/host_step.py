"""CPU offload's host optimizer step: its predicted time against a real step on this machine's CPU.

    python -m benchmarks.accuracy.host_step                  # 1 and 2 threads, 16 and 64 MiB tensors
    python -m benchmarks.accuracy.host_step --smoke          # CI: 1 thread, small tensors

The time model prices an offloaded optimizer step as memory-bound (``host_step_bytes``,
``schedule.host_step_time``): the bytes the configured optimizer's own ops move per element,
counted from its ops, times the rank's elements; the bytes of ops that update a tensor in
place at the rate an in-place update reaches, the rest at a copy's. On a GPU's ``this``
profile both rates are measured on its host (``measure_host_side``: 1 GiB each, larger than a
server CPU's cache, as a shard's optimizer state is); here the same two are measured at the
benchmark's threads, and the same optimizers step for real, built as an offloaded run builds
them (per tensor, torch's choice for host tensors; ``foreach`` where a row asks), the gradients clipped first (``trainer.grad_clip``'s default), on fp32 CPU
tensors: 8 of them, as a shard of several layers is, of 16 MiB (Llama 2 7B's largest shard at
8 ranks is 21.5 MiB: glibc serves its temporaries from the heap again and again) and of 64
MiB (at or above glibc's largest mmap threshold, 32 MiB, as ``model=gpt_7b``'s shards at 8
ranks are: each step's temporaries are new pages, faulted in, which the rule prices at a new
page's cost where the host's is known, as on a GPU's ``this`` profile: here measured too,
``measure_fresh_page_s``). Prints the median step (after two warm-ups)
beside the prediction, as a Markdown table, and writes outputs/benchmarks/host_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from benchmarks.common import markdown, save
from sharded_exp.config import OptimizerConfig
from sharded_exp.measure.host_malloc import DYNAMIC_THRESHOLD_MAX
from sharded_exp.measure.machine import (
    HOST_MEMORY_COPY_BYTES,
    measure_bandwidth,
    measure_fresh_page_s,
    measure_in_place,
)
from sharded_exp.optim import optimizer_spec
from sharded_exp.predict.step_time import host_step_bytes
from sharded_exp.speed.schedule import host_step_time

OPTIMIZERS = {
    "adamw, decay 0.01": {"name": "adamw", "weight_decay": 0.01},  # per tensor: an offloaded run's default
    "adamw foreach, decay 0.01": {"name": "adamw", "weight_decay": 0.01, "foreach": True},
    "sgd, momentum 0.9": {"name": "sgd", "momentum": 0.9},
}
TENSORS = 8
CLIP = 1.0


def measured_step_s(settings: dict, per_tensor: int, repeats: int) -> float:
    """The median seconds of a real clipped step of ``settings``' optimizer over 8 tensors."""
    cfg = OmegaConf.structured(OptimizerConfig(**settings))
    model = torch.nn.Sequential(*(torch.nn.Linear(per_tensor, 1, bias=False) for _ in range(TENSORS)))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer = optimizer_spec(cfg, model, torch.device("cpu")).build()  # as an offloaded run builds it
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if i >= 2:  # the first makes the state
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="1 thread, 1 MiB tensors, 3 repeats")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tensor_mib, args.threads, args.repeats = [1], [1], 3
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy_Bps = measure_bandwidth(0.5, HOST_MEMORY_COPY_BYTES) * 1e9
        in_place_Bps = measure_in_place(0.5, HOST_MEMORY_COPY_BYTES) * 1e9
        page_s = measure_fresh_page_s()
        for mib in args.tensor_mib:
            per_tensor = mib * 2**20 // 4
            elements = TENSORS * per_tensor
            mapped = elements if per_tensor * 4 >= DYNAMIC_THRESHOLD_MAX else 0  # glibc's dynamic rule
            for label, settings in OPTIMIZERS.items():
                cfg = OmegaConf.create({"optimizer": OptimizerConfig(**settings), "trainer": {"grad_clip": CLIP}})
                moved = host_step_bytes(cfg)
                predicted = host_step_time(elements, moved, copy_Bps, in_place_Bps, mapped, page_s)
                measured = measured_step_s(settings, per_tensor, args.repeats)
                rows.append({
                    "optimizer": label, "threads": threads, "tensor_mib": mib, "elements": elements,
                    "in_place_bytes": moved.in_place, "out_of_place_bytes": moved.out_of_place,
                    "copy_GBps": copy_Bps / 1e9, "in_place_GBps": in_place_Bps / 1e9, "new_bytes": moved.new_tensors,
                    "mapped_elements": mapped, "fresh_page_s": page_s,
                    "predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                    "error_pct": 100 * (predicted - measured) / measured,
                })  # fmt: skip
    header = ["optimizer", "threads", "tensors", "bytes in place / not (new)", "copy, in-place GB/s", "page us",
              "predicted ms", "measured ms", "error"]  # fmt: skip
    print(markdown(header, [[r["optimizer"], r["threads"], f"8 x {r['tensor_mib']} MiB",
                             f"{r['in_place_bytes']:.0f} / {r['out_of_place_bytes']:.0f} ({r['new_bytes']:.0f})",
                             f"{r['copy_GBps']:.1f}, {r['in_place_GBps']:.1f}",
                             f"{r['fresh_page_s'] * 1e6:.3f}" if r["mapped_elements"] else "-",
                             f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}%"]
                            for r in rows]))  # fmt: skip
    save("host_step", {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
