"""The same job in PyTorch Lightning, for benchmarks/harness/lightning_vs.py (optional extra:
``pip install -e ".[lightning]"``).

    python -m benchmarks.harness.lightning_job --out outputs/benchmarks/lightning.json [overrides ...]

Same model and data as ``python -m sharded_exp`` with the same overrides (built by the
same registries from the same composed config), Adam with the same two parameter groups,
gradient clipping 1.0, ``strategy="ddp"`` on CPU with ``trainer.world_size`` processes,
no logger, no checkpointing, no progress bar. Rank 0 writes per-step wall times, the
time of the first step and every rank's peak RSS to ``--out``.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from benchmarks.harness.peer import Clock, batches, write_peer_result
from sharded_exp.compose import compose
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.precision import Precision


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


class Timing(pl.Callback):
    def __init__(self, clock: Clock):
        self.clock = clock

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.clock.step_begins()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.step_ends()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = OmegaConf.create(OmegaConf.to_container(compose(args.overrides), resolve=True, enum_to_str=True))
    tc = cfg.trainer
    precision = Precision.of(cfg).lightning
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
        callbacks=[Timing(clock)],
    )
    trainer.fit(Module(cfg), DataLoader(batches(cfg, tc.steps), batch_size=None))
    write_peer_result(args.out, clock, tc.warmup_steps, pl.__version__)


if __name__ == "__main__":
    main()
