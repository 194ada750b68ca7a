"""The CUDA path on a GPU machine: every strategy and precision at world size 1.

    python -m benchmarks.accuracy.gpu_check                         # on a machine with CUDA (NCCL, 1 GPU)
    python -m benchmarks.accuracy.gpu_check --accelerator cpu --steps 3 --strategies ddp fsdp   # dry run

One job per (strategy, precision), each through the real launcher: CUDA allocator
statistics (peak allocated and reserved MiB, allocation retries, OOMs), model states
measured by walking the real tensors next to the memory model's prediction, the CUDA
peak next to the peak the parent predicted with a fake step on the CUDA device (signed
error: below zero the prediction was too low), and MFU against the device's table peak.
Prints one Markdown table; writes outputs/benchmarks/gpu_check.json. Exit code 1 if any
job failed or a model-state prediction is off by more than 2%.

    python -m benchmarks.accuracy.gpu_check --hang                  # NCCL hang diagnosis on one GPU

``--hang`` runs one job whose rank stalls its GPU at step 3 (fault ``stall``: the step's
collectives wait behind a sleeping kernel past ``trainer.timeout_s``), and reports how
long the job took to end, its error, and whether torch's flight recorder dumped
``nccl_trace_rank_0`` into the run directory (read it with ``torchfrtrace``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import OUT, markdown, run, save, strategy_names

STRATEGY_NAMES = strategy_names()
PRECISIONS = ["32", "16", "bf16"]
MODEL = ["model=gpt", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.seq_len=256"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--strategies", nargs="+", default=STRATEGY_NAMES)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hang", action="store_true", help="only the NCCL hang case")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="trainer.timeout_s of the hang case")
    args = parser.parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or --accelerator cpu for a dry run", file=sys.stderr)
        return 2
    if args.hang:
        return hang_case(args)
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"

    rows, data, bad = [], [], 0
    for strategy in args.strategies:
        for prec in args.precisions:
            overrides = [
                *MODEL,
                f"strategy={strategy}",
                f"precision={prec}",
                f"trainer.accelerator={args.accelerator}",
                "trainer.world_size=1",
                f"trainer.steps={args.steps}",
                "trainer.warmup_steps=2",
                f"trainer.batch_size={args.batch_size}",
                "trainer.progress_bar=false",
                "logger=none",
            ]
            try:
                result = run(overrides, f"gpu_check/{strategy}_{prec}")
            except RuntimeError as exc:
                bad += 1
                rows.append([strategy, prec, "failed", str(exc)[:80], "", "", "", "", "", "", "", ""])
                continue
            mem = result["memory"]
            rank = mem["per_rank"][0]
            predicted_peak = rank.get("predicted_peak_mib")
            peak_error = rank.get("peak_rel_error")
            mfu = result["throughput"].get("mfu_pct")
            error = mem["model_states_rel_error_max"]
            bad += int(error is None or error > 0.02)
            data.append(
                {"strategy": strategy, "precision": prec, "result": result, "predicted_peak_mib": predicted_peak}
            )
            rows.append(
                [
                    strategy,
                    prec,
                    f"{rank['peak_allocated_mib']:.1f}",
                    f"{rank['peak_reserved_mib']:.1f}" if rank.get("peak_reserved_mib") is not None else "-",
                    rank.get("alloc_retries", "-"),
                    f"{mem['model_states_mib_max']:.1f}",
                    f"{mem['predicted_model_states_mib_max']:.1f}",
                    f"{error:.2%}",
                    "-" if predicted_peak is None else f"{predicted_peak:.1f}",
                    "-" if peak_error is None else f"{peak_error:+.1%}",
                    f"{result['throughput']['tokens_per_s']:.0f}",
                    "-" if mfu is None else f"{mfu:.1f}",
                ]
            )
    print(f"{device}; world size 1; {' '.join(MODEL)} batch {args.batch_size}; {args.steps} steps")
    header = [
        "strategy",
        "precision",
        "peak alloc MiB",
        "peak reserved MiB",
        "alloc retries",
        "states MiB",
        "predicted states MiB",
        "states error",
        "predicted peak MiB",
        "peak error",
        "tokens/s",
        "MFU %",
    ]
    print(markdown(header, rows))
    print(f"wrote {save('gpu_check', {'device': device, 'args': vars(args), 'results': data})}")
    return 1 if bad else 0


def hang_case(args) -> int:
    """One rank, a device stall at step 3 that outlasts trainer.timeout_s."""
    out = OUT / "gpu_check" / "hang"
    env = {
        **os.environ,
        "SHARDED_EXP_FAULT": "rank=0,step=3,kind=stall",
        "SHARDED_EXP_STALL_S": str(3 * args.timeout_s),
    }
    cmd = [sys.executable, "-m", "sharded_exp", *MODEL, "strategy=ddp", f"trainer.accelerator={args.accelerator}",
           "trainer.world_size=1", "trainer.steps=10", "trainer.warmup_steps=1", f"trainer.timeout_s={args.timeout_s}",
           "trainer.progress_bar=false", "logger=none", f"hydra.run.dir={out}"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=10 * args.timeout_s + 120)
    seconds = time.time() - t0
    traces = sorted(p.name for p in out.glob("nccl_trace_rank_*"))
    print(
        f"hang case: exit {proc.returncode} after {seconds:.1f} s (timeout_s={args.timeout_s:g}); flight recorder dumps: {traces or 'none'}"
    )
    print(
        markdown(
            ["exit", "seconds", "dumps", "error"],
            [
                [
                    proc.returncode,
                    f"{seconds:.1f}",
                    len(traces),
                    proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else "",
                ]
            ],
        )
    )
    save(
        "gpu_check_hang", {"exit": proc.returncode, "seconds": seconds, "traces": traces, "stderr": proc.stderr[-4000:]}
    )
    return 0 if proc.returncode != 0 and (traces or args.accelerator == "cpu") else 1


if __name__ == "__main__":
    sys.exit(main())
