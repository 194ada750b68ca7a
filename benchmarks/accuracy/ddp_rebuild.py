"""DDP's bucket rebuild: real DDP's buckets on this CPU against what the fake step tells the
CUDA allocator's trace (issue 47).

    python -m benchmarks.accuracy.ddp_rebuild                  # the GPU round's small GPT (width 1024, 8 blocks, fp32)
    python -m benchmarks.accuracy.ddp_rebuild model=hf_gpt2 strategy.bucket_cap_mb=5   # any job's overrides, under ddp

Real: the job's model under DDP (``strategies/ddp.py``'s ``wrap_ddp``, as a run wraps it) on a
gloo group of one rank in this process, two forward and backward passes of one sample from
the job's task, then one more forward; DDP's own record of its buckets
(``_get_ddp_logging_data()``: ``bucket_sizes`` of the first iteration, ``rebuilt_bucket_sizes``
after the rebuild before the second forward). Told: the same job's fake step (a fake process
group, CPU kernels) with a watcher on ``sharded_exp.measure.tracker.reallocated``, which a
fake CUDA step's allocator trace turns into the old bucket's free and the new buckets'
mallocs. The bytes depend on the model's parameters and ``bucket_cap_mb`` only, not on the
batch. ``strategy=ddp`` is set after the overrides (zero1 and oss wrap the same DDP). Under
``strategy.find_unused_parameters=true`` real DDP never rebuilds (no rebuilt sizes: DIFFER).
Prints both and whether they agree; writes outputs/benchmarks/ddp_rebuild.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import markdown, save
from sharded_exp.compose import compose
from sharded_exp.data import Task, probe_task
from sharded_exp.measure.tracker import watching_reallocations
from sharded_exp.models import build_model
from sharded_exp.precision import autocast
from sharded_exp.predict.fake_step import fake_step
from sharded_exp.strategies.ddp import wrap_ddp

SMALL = ["model=gpt", "model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.seq_len=512"]
"""benchmarks/accuracy/gpu_check.py's small model, whose fp32 DDP runs the device round measured."""


def _sizes(text) -> list[int]:
    return [int(n) for n in str(text).split(", ") if n]


def real_buckets(cfg) -> tuple[list[int], list[int]]:
    """(first iteration's bucket bytes, rebuilt bucket bytes) of real DDP on one gloo rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(cfg.trainer.seed)
        model = wrap_ddp(cfg.strategy, build_model(cfg.model, cfg.trainer.freeze), torch.device("cpu"))
        batch = probe_task(cfg.data, cfg.model)(0, 0, 0)
        for _ in range(2):  # under the precision's autocast, as a run steps: its casts order the backward
            with autocast(cfg.precision, "cpu"):
                loss = Task.loss_of(model(**batch))
            loss.backward()
        with autocast(cfg.precision, "cpu"):
            model(**batch)
        logged = model._get_ddp_logging_data()
        return _sizes(logged["bucket_sizes"]), _sizes(logged.get("rebuilt_bucket_sizes", ""))
    finally:
        dist.destroy_process_group()


def told_buckets(cfg) -> list[tuple[list[int], list[int], bool]]:
    """What the fake step tells: (old buckets' bytes, new buckets' bytes, old freed last)."""
    told = []
    with watching_reallocations(lambda old, sizes, last: told.append(([t.nbytes for t in old], sizes, last))):
        fake_step(cfg, 1, 0, "cpu", flops=False)
    return told


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help=f"the job's overrides (default: {' '.join(SMALL)})")
    args = parser.parse_args()
    overrides = args.overrides or SMALL
    cfg = compose([*overrides, "strategy=ddp", "trainer.batch_size=1", "logger=none"])
    first, rebuilt = real_buckets(cfg)
    told = told_buckets(cfg)
    # one bucket as big again is told only where gradients still view the old one
    agree = [(t[0], t[1]) for t in told] == [(first, rebuilt)] or (told == [] and rebuilt == first)
    mib = lambda sizes: ", ".join(f"{s / 2**20:.2f}" for s in sizes)  # noqa: E731
    print(f"DDP's buckets, {' '.join(overrides)} (bucket_cap_mb={cfg.strategy.bucket_cap_mb}), MiB")
    rows = [["real DDP, first iteration", len(first), mib(first)], ["real DDP, rebuilt", len(rebuilt), mib(rebuilt)]]
    rows += [["fake step, told (old)", len(t[0]), mib(t[0])] for t in told]
    rows += [["fake step, told (new)", len(t[1]), mib(t[1])] for t in told]
    print(markdown(["what", "buckets", "MiB each"], rows))
    print("agree" if agree else "DIFFER")
    path = save(
        "ddp_rebuild", {"overrides": overrides, "first": first, "rebuilt": rebuilt, "told": told, "agree": agree}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
