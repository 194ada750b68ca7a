"""strategies/zero1.py: ZeroRedundancyOptimizer's partition (greedy, each group largest first)
and memory model, held against torch's own optimizer under a fake process group."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.strategies.zero1 import ZeRO1, ZeRO1Config

SHAPES = [(7, 5), (5,), (5, 3), (3,), (3, 9), (9,)]  # 35, 5, 15, 3, 27, 9 elements


def test_zero1_visits_the_largest_tensors_first():
    # visited 35 (r0), 27 (r1), 15 (r2), 9 (r2 at 15), 5 (r2 at 24 < 27), 3 (r1 at 27 < 29)
    assert ZeRO1.memory.partition([[math.prod(s) for s in SHAPES]], 3) == [0, 2, 2, 1, 1, 2]


def _owners_from(per_rank_groups, params) -> list[int]:
    index = {id(p): i for i, p in enumerate(params)}
    owners = [-1] * len(params)
    for rank, groups in enumerate(per_rank_groups):
        for group in groups:
            for p in group["params"]:
                owners[index[id(p)]] = rank
    return owners


@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2), (5, 0)])
def test_the_partition_and_state_are_torch_zero_redundancy_optimizers(fake_group, world_size, rank):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    fake_group(world_size, rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 9), nn.Linear(9, 2))
    weights = [p for p in net.parameters() if p.dim() == 2]
    biases = [p for p in net.parameters() if p.dim() == 1]
    optimizer = ZeroRedundancyOptimizer([{"params": weights}, {"params": biases}],
                                        optimizer_class=torch.optim.Adam, lr=1e-3)  # fmt: skip
    groups = [[p.numel() for p in weights], [p.numel() for p in biases]]
    owners = ZeRO1.memory.partition(groups, world_size)
    assert owners == _owners_from(optimizer._partition_parameters(), weights + biases)

    net(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    real = sum(
        t.numel() * t.element_size() for s in optimizer.optim.state.values() for k, t in s.items() if k != "step"
    )
    shapes = [tuple(p.shape) for p in weights + biases]
    held = ZeRO1.memory.resident_numel(OmegaConf.structured(ZeRO1Config), shapes, owners, rank, world_size)
    assert real == 2 * 4 * sum(held["optimizer"])
    assert held["params"] == held["grads"] == sum(p.numel() for p in net.parameters())


def test_zero1_facts():
    assert ZeRO1.traits.sharding == 1 and ZeRO1.traits.checkpoint_format_auto == "dcp"
    assert ZeRO1.traits.requires == () and ZeRO1.traits.grads_differ_across_ranks and not ZeRO1.traits.clip_reads_values
