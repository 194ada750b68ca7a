"""A LightningModule under Lightning's own strategies, measured by sharded_exp's callback.

    python examples/lightning_probe.py --strategy ddp       # 2 CPU processes (Lightning starts them)
    python examples/lightning_probe.py --strategy fsdp
    sharded-exp-report outputs/probe_lightning             # ddp and fsdp compared

The module and the Trainer are ordinary ones; the probe is one callback, and writes
outputs/probe_lightning/<strategy>/result.json when training ends.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from sharded_exp.integrations.lightning import MemoryProbe


class Classifier(pl.LightningModule):
    def __init__(self, width: int = 512, depth: int = 4):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
        self.net = nn.Sequential(nn.Linear(64, width), *layers, nn.Linear(width, 10))

    def configure_model(self):
        # Under Lightning's FSDP2 strategy (ModelParallelStrategy): each layer, then the root.
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(n: int, batch_size: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def strategy_for(name: str, accelerator: str, devices: int):
    """Lightning's strategy by its name. ``fsdp`` on CPU is Lightning's FSDP2 strategy
    (``ModelParallelStrategy``, which shards in ``configure_model``): its FSDPStrategy (FSDP1)
    needs a GPU, and torch 2.13's FSDP1 refuses to run without an accelerator."""
    if name == "fsdp" and accelerator == "cpu":
        ModelParallelStrategy = pl.strategies.ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name


def main(argv: list[str] | None = None, callbacks: list = ()) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ddp", help="any Lightning strategy name: ddp, fsdp, ddp_spawn, ...")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument(
        "--width", type=int, default=512, help="hidden width (small width, large batch: activations dominate)"
    )
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    run_dir = args.run_dir or os.path.join("outputs", "probe_lightning", args.strategy)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy_for(args.strategy, args.accelerator, args.devices), max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[MemoryProbe(run_dir), *callbacks],
    )  # fmt: skip
    trainer.fit(Classifier(args.width, args.depth), data(args.steps * args.batch_size * args.devices, args.batch_size))
    if trainer.global_rank == 0:
        print(f"result: {run_dir}/result.json")


if __name__ == "__main__":
    main()
