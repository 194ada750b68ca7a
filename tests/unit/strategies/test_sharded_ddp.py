"""strategies/sharded_ddp.py: which gradients ShardedDataParallel puts in its reduce buckets
(held against fairscale's own choice under a fake process group), the gradient elements each
rank keeps, its buckets, its set-up transient and its fixed zeroing rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.config import ZeroGrad
from sharded_exp.strategies.residency import greedy_partition
from sharded_exp.strategies.sharded_ddp import ShardedDDP, ShardedDDPConfig, bucketed, resident_grad_numel


def _cfg(**kw):
    return OmegaConf.structured(ShardedDDPConfig(**kw))


def test_buckets_fill_smallest_first_and_a_tensor_that_would_fill_one_exactly_is_left_out():
    # owners r0: 1, 4, 6; r1: 2, 3. Capacity 7 (< 16 elements): r0 takes 1, 4 (5), not 6;
    # r1 takes 2 then 3 would make 5 < 7: taken.
    assert bucketed(7, [6, 4, 1, 2, 3], [0, 0, 0, 1, 1], 2) == [False, True, True, True, True]
    # capacity 5: r0 takes 1 (1), 4 would make exactly 5: left out; r1 takes 2, not 3 (5)
    assert bucketed(5, [6, 4, 1, 2, 3], [0, 0, 0, 1, 1], 2) == [False, False, True, True, False]


def test_no_buckets_on_one_rank_or_with_buckets_off():
    assert bucketed(2**23, [4, 4], [0, 0], 1) == [False, False]
    assert bucketed(0, [4, 4], [0, 1], 2) == [False, False]


def test_the_capacity_is_at_most_the_model_size():
    # capacity min(100, 10) = 10; by size: 1 (fill 1), 4 (fill 5), 5 would make exactly 10: left out
    assert bucketed(100, [4, 5, 1], [0, 0, 0], 2) == [True, False, True]


def test_bucketed_gradients_are_kept_by_every_rank_the_others_by_their_owner_only():
    numels, owners = [6, 4, 1, 2, 3], [0, 0, 0, 1, 1]  # capacity 5: only the 1 and the 2 are bucketed
    assert resident_grad_numel(5, numels, owners, 0, 2) == 1 + 2 + 6 + 4
    assert resident_grad_numel(5, numels, owners, 1, 2) == 1 + 2 + 3
    assert resident_grad_numel(0, numels, owners, 1, 2) == 2 + 3  # no buckets: truly sharded
    assert resident_grad_numel(0, numels, owners, 0, 1) == 16  # one rank keeps everything


def test_with_default_buckets_a_small_model_saves_no_gradient_memory():
    numels = [4096, 64, 640, 10]
    owners = greedy_partition([numels], 4)
    for rank in range(4):
        assert resident_grad_numel(2**23, numels, owners, rank, 4) == sum(numels)


def test_the_resident_states_are_osss_with_the_gradients_of_the_bucketing():
    shapes = [(6,), (4,), (1,), (2,), (3,)]
    owners = [0, 0, 0, 1, 1]
    held = ShardedDDP.memory.resident_numel(_cfg(reduce_buffer_size=5), shapes, owners, 1, 2)
    assert held == {"params": 16, "grads": 6, "optimizer": [2, 3]}


def test_every_rank_keeps_every_destinations_bucket_and_the_bucketed_grads_are_views_into_them():
    numels, owners = [6, 4, 1, 2, 3], [0, 0, 0, 1, 1]
    assert ShardedDDP.memory.bucket_numel(_cfg(reduce_buffer_size=7), numels, owners, 0, 2) == (10, 10)
    assert ShardedDDP.memory.bucket_numel(_cfg(reduce_buffer_size=0), numels, owners, 0, 2) == (0, 0)


def test_setting_up_allocates_one_full_bucket_per_owning_destination_at_once():
    shapes = SimpleNamespace(groups=[[(100,), (50,)], [(10,)]], params=160, element_bytes=4.0)
    # greedy over 3 ranks: 100 r0, 50 r1, 10 r2: three destinations of min(64, 160) elements
    assert ShardedDDP.memory.setup_transient_mib(_cfg(reduce_buffer_size=64), shapes, 3) == 3 * 64 * 4 / 2**20
    # 8 ranks, 3 tensors: only 3 destinations; capacity capped at the model's 160 elements
    assert ShardedDDP.memory.setup_transient_mib(_cfg(reduce_buffer_size=2**23), shapes, 8) == 3 * 160 * 4 / 2**20
    assert ShardedDDP.memory.setup_transient_mib(_cfg(reduce_buffer_size=0), shapes, 3) == 0.0
    assert ShardedDDP.memory.setup_transient_mib(_cfg(), shapes, 1) == 0.0


def test_sharded_ddp_always_zeroes_in_place_and_says_why_when_free_was_asked():
    rule = ShardedDDP.traits.zero_grad_rule(ZeroGrad.free)
    assert rule.applied is ZeroGrad.zeros and rule.set_to_none is False and "sharded_ddp" in rule.reason
    assert ShardedDDP.traits.zero_grad_rule(ZeroGrad.zeros).reason == ""


def test_sharded_ddp_facts():
    assert ShardedDDP.traits.sharding == 2 and ShardedDDP.traits.checkpoint_format_auto == "dcp"
    assert ShardedDDP.memory.depth_lines_per_world_size is True and ShardedDDP.traits.requires == ("fairscale",)
    assert ShardedDDP.memory.partition([[35, 5, 15]], 2) == [0, 1, 1]  # OSS's, in order


@pytest.mark.parametrize("world_size, rank", [(2, 0), (3, 2), (4, 1)])
@pytest.mark.parametrize("reduce_buffer_size", [10, 40, 100])
def test_bucketed_is_fairscale_sharded_data_parallels_own_choice(fake_group, world_size, rank, reduce_buffer_size):
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    fake_group(world_size, rank)
    net = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 9), nn.Linear(9, 2))
    model = ShardedDataParallel(net, OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-3),
                                reduce_buffer_size=reduce_buffer_size)  # fmt: skip
    model(torch.randn(2, 7))  # its buckets are set up at the first forward
    params = list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    real = [False] * len(params)
    for chosen, p in zip(model._should_bucket_grad, model._trainable_params):
        real[index[id(p)]] = chosen
    numels = [p.numel() for p in params]
    owners = ShardedDDP.memory.partition([numels], world_size)
    assert bucketed(reduce_buffer_size, numels, owners, world_size) == real
    held, _ = ShardedDDP.memory.bucket_numel(
        _cfg(reduce_buffer_size=reduce_buffer_size), numels, owners, rank, world_size
    )
    assert held == sum(b.buffer.numel() for b in model._bucket_list)  # each shrunk to its fill
