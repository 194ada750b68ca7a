"""The same job in PyTorch Lightning, for benchmarks/lightning_vs.py (optional extra:
``pip install -e ".[lightning]"``).

    python -m benchmarks.lightning_job --out outputs/benchmarks/lightning.json [overrides ...]

Same model and data as ``python -m sharded_exp`` with the same overrides (built by the
same registries from the same composed config), Adam with the same two parameter groups,
gradient clipping 1.0, ``strategy="ddp"`` on CPU with ``trainer.world_size`` processes,
no logger, no checkpointing, no progress bar. Rank 0 writes per-step wall times, the
time of the first step and every rank's peak RSS to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, IterableDataset

from benchmarks.common import compose_cfg
from sharded_exp.data import build_task
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec


class Batches(IterableDataset):
    """The harness's deterministic batches for (step, micro-batch 0, this rank)."""

    def __init__(self, cfg, steps: int):
        self.cfg, self.steps = cfg, steps

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        next_batch = build_task(self.cfg.data, self.cfg.model, self.cfg.trainer.batch_size)
        for step in range(self.steps):
            yield next_batch(step, 0, rank)


class Module(pl.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(cfg.trainer.seed)
        self.model = build_model(cfg.model)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return optimizer_spec(self.cfg.optimizer, self.model).build()


class Clock(pl.Callback):
    """Wall time at the start of every batch and at the end of the last one."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.first_step_unix: float | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = OmegaConf.create(OmegaConf.to_container(compose_cfg(args.overrides), resolve=True, enum_to_str=True))
    tc = cfg.trainer
    precision = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}[str(cfg.precision.name)]
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=tc.world_size,
        strategy="ddp",
        precision=precision,
        max_steps=tc.steps,
        gradient_clip_val=tc.grad_clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    loader = DataLoader(Batches(cfg, tc.steps), batch_size=None)
    trainer.fit(Module(cfg), loader)

    rss = [None] * trainer.world_size
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if trainer.global_rank == 0:
        warm = tc.warmup_steps
        steps = [end - start for start, end in zip(clock.starts, clock.ends)][warm:]
        with open(args.out, "w") as f:
            json.dump(
                {
                    "first_step_unix": clock.first_step_unix,
                    "step_time_s": steps,
                    "loop_time_s_per_step": (clock.ends[-1] - clock.starts[warm]) / (len(clock.ends) - warm),
                    "peak_rss_mib": rss,
                    "version": pl.__version__,
                },
                f,
            )


if __name__ == "__main__":
    main()
