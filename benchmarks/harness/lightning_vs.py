"""sharded_exp against PyTorch Lightning on the same job, side by side in one run.

    pip install -e ".[lightning]"
    python -m benchmarks.harness.lightning_vs                    # MLP, fp32, DDP, 2 CPU ranks, 3 runs each
    python -m benchmarks.harness.lightning_vs --repeats 1 --smoke

Both are started as a user would, from the command line, alternately:
``python -m sharded_exp strategy=ddp logger=none ...`` and ``python -m
benchmarks.harness.lightning_job ...`` (the same model, data, optimizer, clipping, precision and
steps, Lightning's ``strategy="ddp"``). Measured for each: the median step time after the
warm-up, the loop time per step (whole iterations), command to first step, command to
exit, and the largest peak RSS over ranks. Prints a Markdown table, writes
outputs/benchmarks/lightning_vs.json.
"""

from __future__ import annotations

import os
import sys

from benchmarks.harness.peer import compare, parse, run_ours, run_peer

JOB = ["strategy=ddp", "model=mlp", "precision=32", "trainer.world_size=2"]


def main() -> None:
    args, overrides = parse(__doc__.splitlines()[0], JOB, steps=200)

    def lightning(out: str) -> dict:
        path = os.path.join(out, "lightning.json")
        return run_peer([sys.executable, "-m", "benchmarks.harness.lightning_job", "--out", path, *overrides], path)

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
