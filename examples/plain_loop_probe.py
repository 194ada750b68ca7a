"""A plain torch training loop, measured by sharded_exp's probe: 2 CPU processes (gloo).

    torchrun --standalone --nproc-per-node=2 examples/plain_loop_probe.py --wrap ddp
    torchrun --standalone --nproc-per-node=2 examples/plain_loop_probe.py --wrap fsdp
    sharded-exp-report outputs/probe_plain          # the two runs compared: memory saved, speed

The loop is an ordinary one; the probe adds three lines (``with probe(...)``, ``p.step(loss)``)
and writes outputs/probe_plain/<wrap>/result.json. On a GPU machine the same script runs with
``--device cuda`` (NCCL, one GPU per process).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from sharded_exp.probe import probe


def build_model(width: int = 512, depth: int = 4) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(nn.Linear(64, width), *layers, nn.Linear(width, 10))


def wrap(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return model


def batches(rank: int, batch_size: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, 64, generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        yield x.to(device), y.to(device)


def step_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrap", choices=["ddp", "fsdp", "none"], default="ddp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--no-probe", action="store_true", help="the same loop unprobed (the overhead benchmark)")
    args = ap.parse_args(argv)

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = wrap(build_model().to(device), args.wrap, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(rank, args.batch_size, device)
    first = next(data)

    run_dir = args.run_dir or os.path.join("outputs", "probe_plain", args.wrap)
    with probe(model, optimizer, run_dir, samples_per_step=args.batch_size, example=first, step_fn=step_fn) \
            if not args.no_probe else _nothing() as p:  # fmt: skip
        batch = first
        for _ in range(args.steps):
            loss = step_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            p.step(loss)
            batch = next(data)
    if rank == 0 and not args.no_probe:
        print(f"result: {run_dir}/result.json")
    dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def step(self, loss=None):
        return None


if __name__ == "__main__":
    main()
