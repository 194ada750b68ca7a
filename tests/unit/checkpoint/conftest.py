"""Fixtures of the checkpoint unit tests (the gloo group is the root conftest's ``gloo_group``): a tiny strategy (the base
Strategy around a two-layer model and torch.optim.Adam, one step taken so the optimizer has
state), and a writer of small consolidated checkpoints on disk."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch._dynamo  # noqa: F401 -- torch.optim imports it on the first optimizer: paid at collection instead
from torch import nn

from sharded_exp.config import PrecisionConfig
from sharded_exp.strategies.base import Strategy


@pytest.fixture
def make_strategy():
    """``make_strategy(seed=0, lr=0.01, steps=1, weight_decay=0.0)``: the base Strategy around a
    fresh tiny model (``0.weight`` 4x3, ``0.bias`` 4, ``2.weight`` 2x4) with Adam in two groups
    (the weights / the bias), after ``steps`` optimizer steps."""

    def make(seed: int = 0, lr: float = 0.01, steps: int = 1, weight_decay: float = 0.0) -> Strategy:
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
        weights = [module[0].weight, module[2].weight]
        optimizer = torch.optim.Adam(
            [{"params": weights, "weight_decay": weight_decay}, {"params": [module[0].bias], "weight_decay": 0.0}],
            lr=lr,
        )
        strategy = Strategy(module, module, optimizer, PrecisionConfig(), torch.device("cpu"))
        for i in range(steps):
            g = torch.Generator().manual_seed(100 + i)
            loss = module(torch.randn(5, 3, generator=g)).pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return strategy

    return make


@pytest.fixture
def write_checkpoint():
    """``write_checkpoint(directory, step, **meta_overrides)``: a small, valid consolidated
    checkpoint ``<directory>/step_<step>`` (meta.json, train.pt, model.pt, optim.pt) with one
    parameter ``w`` of shape (2, 3) and Adam; returns its path. ``name`` overrides the directory
    name; keyword arguments override meta.json's values."""

    def write(directory, step: int, name: str | None = None, **meta_overrides) -> str:
        path = os.path.join(str(directory), name or f"step_{step:08d}")
        os.makedirs(path)
        meta = {
            "format": 1,
            "checkpoint_format": "consolidated",
            "step": step,
            "strategy": "ddp",
            "world_size": 2,
            "optimizer": "adam",
            "model": {"name": "mlp"},
            "param_shapes": {"w": [2, 3]},
        }
        meta.update(meta_overrides)
        torch.save({"w": torch.zeros(2, 3)}, os.path.join(path, "model.pt"))
        torch.save({"state": {}, "param_groups": []}, os.path.join(path, "optim.pt"))
        torch.save({"scaler": {}, "rng": [], "param_groups": []}, os.path.join(path, "train.pt"))
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)
        return path

    return write
