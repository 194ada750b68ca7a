"""sharded_exp against PyTorch Lightning on the same job, side by side in one run.

    pip install -e ".[lightning]"
    python -m benchmarks.lightning_vs                    # MLP, fp32, DDP, 2 CPU ranks, 3 runs each
    python -m benchmarks.lightning_vs --repeats 1 --smoke

Both are started as a user would, from the command line, alternately:
``python -m sharded_exp strategy=ddp logger=none ...`` and ``python -m
benchmarks.lightning_job ...`` (the same model, data, optimizer, clipping, precision and
steps, Lightning's ``strategy="ddp"``). Measured for each: the median step time after the
warm-up, the loop time per step (whole iterations), command to first step, command to
exit, and the largest peak RSS over ranks. Prints a Markdown table, writes
outputs/benchmarks/lightning_vs.json.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.peer import compare, run_ours, run_peer

JOB = ["strategy=ddp", "model=mlp", "precision=32", "trainer.world_size=2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few steps, one run each (CI)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    overrides = [*JOB, f"trainer.steps={args.steps}", f"trainer.warmup_steps={args.warmup}", *args.overrides]

    def lightning(out: str) -> dict:
        path = os.path.join(out, "lightning.json")
        return run_peer([sys.executable, "-m", "benchmarks.lightning_job", "--out", path, *overrides], path)

    compare(
        "lightning_vs",
        "lightning",
        lambda out: run_ours(overrides, out),
        lightning,
        args.repeats,
        " ".join(overrides),
        args,
    )


if __name__ == "__main__":
    main()
