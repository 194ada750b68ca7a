"""sharded_exp against the Hugging Face Trainer on the same BERT job, side by side in one run.

    pip install -e ".[benchmark]"
    python -m benchmarks.harness.hf_trainer_vs                   # hf_bert, fp32, DDP, 2 CPU ranks, 3 runs each
    python -m benchmarks.harness.hf_trainer_vs --repeats 1 --smoke

The peer users would run instead: ``torchrun --nproc-per-node=2 -m
benchmarks.harness.hf_trainer_job ...`` (the Trainer's DDP on gloo) against ``python -m
sharded_exp strategy=ddp model=hf_bert ...``, alternately, same model and seed, same
batches, AdamW, clipping and steps. Medians of step time, loop time per step, command to
first step, command to exit, peak RSS; writes outputs/benchmarks/hf_trainer_vs.json.
"""

from __future__ import annotations

import os
import sys

from benchmarks.harness.peer import compare, parse, run_ours, run_peer

JOB = [
    "strategy=ddp",
    "model=hf_bert",
    "optimizer=adamw",
    "precision=32",
    "trainer.world_size=2",
    "trainer.batch_size=8",
]


def main() -> None:
    args, overrides = parse(__doc__.splitlines()[0], JOB, steps=100)

    def hf_trainer(out: str) -> dict:
        path = os.path.join(out, "hf_trainer.json")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        return run_peer([*launcher, "-m", "benchmarks.harness.hf_trainer_job", "--out", path, *overrides], path)

    ours = lambda out: run_ours(overrides, out)  # noqa: E731
    compare("hf_trainer_vs", "hf_trainer", ours, hf_trainer, args.repeats, " ".join(overrides), args)


if __name__ == "__main__":
    main()
