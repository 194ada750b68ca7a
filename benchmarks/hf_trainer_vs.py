"""sharded_exp against the Hugging Face Trainer on the same BERT job, side by side in one run.

    pip install -e ".[benchmark]"
    python -m benchmarks.hf_trainer_vs                   # hf_bert, fp32, DDP, 2 CPU ranks, 3 runs each
    python -m benchmarks.hf_trainer_vs --repeats 1 --smoke

The peer users would run instead: ``torchrun --nproc-per-node=2 -m
benchmarks.hf_trainer_job ...`` (the Trainer's DDP on gloo) against ``python -m
sharded_exp strategy=ddp model=hf_bert ...``, alternately, same model and seed, same
batches, AdamW, clipping and steps. Medians of step time, loop time per step, command to
first step, command to exit, peak RSS; writes outputs/benchmarks/hf_trainer_vs.json.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.peer import compare, run_ours, run_peer

JOB = [
    "strategy=ddp",
    "model=hf_bert",
    "optimizer=adamw",
    "precision=32",
    "trainer.world_size=2",
    "trainer.batch_size=8",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few steps, one run each (CI)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    # No evaluation pass on our side: the Trainer runs none either.
    overrides = [*JOB, f"trainer.steps={args.steps}", f"trainer.warmup_steps={args.warmup}", *args.overrides]

    def hf_trainer(out: str) -> dict:
        path = os.path.join(out, "hf_trainer.json")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        return run_peer([*launcher, "-m", "benchmarks.hf_trainer_job", "--out", path, *overrides], path)

    ours = lambda out: run_ours([*overrides, "trainer.eval_batches=0"], out)  # noqa: E731
    compare("hf_trainer_vs", "hf_trainer", ours, hf_trainer, args.repeats, " ".join(overrides), args)


if __name__ == "__main__":
    main()
