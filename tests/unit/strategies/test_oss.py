"""strategies/oss.py: fairscale OSS's memory model (full params and grads, the optimizer state
of the tensors its greedy in-order partition gives the rank), held against a real OSS
optimizer's state under a fake process group."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.strategies.oss import OSS, OSSConfig

SHAPES = [(7, 5), (5,), (5, 3), (3,), (3, 9), (9,)]  # 35, 5, 15, 3, 27, 9 elements


def test_oss_partitions_in_parameter_order_not_largest_first():
    # 35 r0; 5 r1; 15 r2; 3 r1 (5); 27 r1 (8); 9 r2 (15)
    assert OSS.memory.partition([[math.prod(s) for s in SHAPES]], 3) == [0, 1, 2, 1, 1, 2]


@pytest.mark.parametrize("rank, owned", [(0, [35]), (1, [5, 3, 27]), (2, [15, 9])])
def test_each_rank_keeps_the_optimizer_state_of_its_own_shard_and_full_params_and_grads(rank, owned):
    owners = OSS.memory.partition([[math.prod(s) for s in SHAPES]], 3)
    held = OSS.memory.resident_numel(OmegaConf.structured(OSSConfig), SHAPES, owners, rank, 3)
    assert held == {"params": 94, "grads": 94, "optimizer": owned}


def test_oss_facts():
    assert OSS.traits.sharding == 1 and OSS.traits.checkpoint_format_auto == "dcp"
    assert (
        OSS.traits.requires == ("fairscale",)
        and OSS.traits.clip_reads_values is True
        and OSS.traits.grads_differ_across_ranks
    )
    assert OSS.memory.bucket_numel(OmegaConf.structured(OSSConfig), [10, 5], [0, 1], 0, 2) == (15, 0)  # DDP's bucket


@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2), (4, 0)])
def test_the_predicted_optimizer_state_is_what_a_real_oss_adam_holds(fake_group, world_size, rank):
    from fairscale.optim import OSS as FairscaleOSS

    fake_group(world_size, rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 9))
    optimizer = FairscaleOSS(net.parameters(), optim=torch.optim.Adam, lr=1e-3)
    net(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    real = sum(
        t.numel() * t.element_size() for s in optimizer.optim.state.values() for k, t in s.items() if k != "step"
    )
    shapes = [tuple(p.shape) for p in net.parameters()]
    owners = OSS.memory.partition([[math.prod(s) for s in shapes]], world_size)
    held = OSS.memory.resident_numel(OmegaConf.structured(OSSConfig), shapes, owners, rank, world_size)
    assert real == 2 * 4 * sum(held["optimizer"])  # Adam: exp_avg and exp_avg_sq, float32
