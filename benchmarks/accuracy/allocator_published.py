"""Predicted against published: what the planner's CUDA allocator columns say for runs whose
memory others published, and a 7B FSDP plan with and without expandable segments.

    python -m benchmarks.accuracy.allocator_published            # every row (minutes on 2 cores)
    python -m benchmarks.accuracy.allocator_published --quick    # the recipe only (no plan)

Rows (each published figure with its source; the planner command is printed beside it):

- PyTorch's ZeroRedundancyOptimizer recipe builds 20 x ``Linear(2000, 2000)`` on the GPU and
  prints ``max_memory_allocated`` after building: 335 MB. Replayed here through the allocator
  model (each layer's weight, then its bias, as ``.to(rank)`` moves them).
- torchtitan PR #165 (Llama-2-7B shapes, FSDP2 over 8 H100s, full AC): peak reserved 31.02 GiB,
  peak active 22.73 GiB. The PR text at hand does not give the batch: torchtitan's Llama-2-7B
  config of that time is assumed (local batch 8, sequence 2048, bf16 parameters, fp32
  reduction, AdamW).
- torchtitan's published Llama 3.1 8B run (FSDP over 8 ranks, local batch 2, sequence 8192,
  selective AC): max reserved 82.4 GiB.

Prints Markdown; writes outputs/benchmarks/allocator_published.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

GIB = 2**30
LLAMA2_7B = ["model=hf_llama_7b", "precision=bf16", "strategy=fsdp", "trainer.batch_size=8"]
LLAMA31_8B = [
    "model=hf_llama", "model.vocab_size=128256", "model.seq_len=8192", "model.config.max_position_embeddings=8192",
    "model.config.hidden_size=4096", "model.config.intermediate_size=14336", "model.config.num_hidden_layers=32",
    "model.config.num_attention_heads=32", "model.config.num_key_value_heads=8", "+model.config.rope_theta=500000.0",
    "precision=bf16", "strategy=fsdp", "trainer.batch_size=2",
]  # fmt: skip
PUBLISHED = {
    "torchtitan PR #165: Llama-2-7B, FSDP2 x8, full AC (reserved 31.02 GiB, active 22.73)": (
        [*LLAMA2_7B, "plan.world_sizes=[8]", "plan.strategies=[fsdp]", "plan.levers=[ac]"], 31.02, 22.73),
    "torchtitan Llama 3.1 8B, FSDP x8, batch 2, seq 8192, selective op AC (reserved 82.4 GiB)": (
        [*LLAMA31_8B, "plan.world_sizes=[8]", "plan.strategies=[fsdp]", "plan.levers=[ac_selective_op]"], 82.4, None),
    "the same run under our selective policy (every matmul kept), against the same 82.4 GiB": (
        [*LLAMA31_8B, "plan.world_sizes=[8]", "plan.strategies=[fsdp]", "plan.levers=[ac_selective]"], 82.4, None),
}  # fmt: skip
SEVEN_B = ["model=gpt_7b", "trainer.batch_size=1", "plan.world_sizes=[8,64]", "plan.strategies=[fsdp]"]
"""The 7B FSDP plan at 8 and 64 ranks, with and without ``expandable_segments:True``."""


def recipe_mb() -> float:
    """The ZeroRedundancyOptimizer recipe's ``max_memory_allocated`` after building, in MB
    (1e6 bytes, as the recipe prints it), from the allocator model."""
    from sharded_exp.predict.allocator import Allocator

    alloc = Allocator()
    for _ in range(20):
        alloc.malloc(2000 * 2000 * 4)  # the weight, fp32
        alloc.malloc(2000 * 4)  # the bias
    return alloc.stats()["allocated_bytes.all.peak"] / 1e6


def plan(overrides: list[str]) -> list[dict]:
    """The planner's JSON rows, run as a user runs it."""
    cmd = [sys.executable, "-m", "sharded_exp.plan", *overrides, "plan.format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout)["rows"]


def command(overrides: list[str]) -> str:
    return "python -m sharded_exp.plan " + " ".join(f"'{o}'" if "[" in o else o for o in overrides)


def published_rows() -> tuple[list[list], dict]:
    rows, out = [], {}
    got = recipe_mb()
    rows.append(["ZeroRedundancyOptimizer recipe, 20 x Linear(2000, 2000): max_memory_allocated 335 MB",
                 f"{got:.1f} MB allocated", f"{(got - 335) / 335:+.1%}", "python -m benchmarks.accuracy.allocator_published --quick"])  # fmt: skip
    out["recipe_mb"] = got
    for name, (overrides, reserved, active) in PUBLISHED.items():
        r = plan(overrides)[0]
        error = (r["reserved_gib"] - reserved) / reserved if r.get("reserved_gib") is not None else None
        figures = (f"peak {r['total_gib']:.2f}, allocated {r['allocated_gib']:.2f}, reserved {r['reserved_gib']:.2f}, "
                   f"device total {r['device_total_gib']:.2f} GiB")  # fmt: skip
        errors = f"reserved {error:+.1%}" + (f"; allocated vs active {(r['allocated_gib'] - active) / active:+.1%}"
                                             if active else "")  # fmt: skip
        rows.append([name, figures, errors, command(overrides)])
        out[name] = {k: r.get(k) for k in ("total_gib", "allocated_gib", "reserved_gib", "device_total_gib", "method")}
    return rows, out


def seven_b_rows() -> tuple[list[list], dict]:
    rows, out = [], {}
    for conf in ("", "expandable_segments:True"):
        overrides = [*SEVEN_B, f"plan.alloc_conf={conf}" if conf else "plan.alloc_conf=''"]
        for r in plan(overrides):
            rows.append([r["world_size"], conf or "torch's defaults", f"{r['total_gib']:.2f}", f"{r['allocated_gib']:.2f}",
                         f"{r['reserved_gib']:.2f}", f"{r['device_total_gib']:.2f}", command(overrides)])  # fmt: skip
            out[f"{r['world_size']} {conf or 'default'}"] = {k: r.get(k) for k in ("total_gib", "allocated_gib",
                                                                                  "reserved_gib", "device_total_gib")}  # fmt: skip
    return rows, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the recipe only (no plan)")
    args = parser.parse_args()
    if args.quick:
        print(f"ZeroRedundancyOptimizer recipe: {recipe_mb():.1f} MB allocated after building (published: 335 MB)")
        return 0
    rows, out = published_rows()
    print(markdown(["published", "predicted", "error", "command"], rows))
    seven, out["7b_fsdp"] = seven_b_rows()
    print()
    print(markdown(["ranks", "PYTORCH_CUDA_ALLOC_CONF", "peak GiB", "allocated GiB", "reserved GiB", "device total GiB",
                    "command"], seven))  # fmt: skip
    save("allocator_published", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
