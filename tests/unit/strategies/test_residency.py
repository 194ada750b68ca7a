"""strategies/residency.py: the greedy optimizer-state partition (held against fairscale OSS's own)
and the base memory model (every state whole on every rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_exp.strategies.residency import MemoryModel, greedy_partition


# ------------------------------------------------------------------ greedy_partition
def test_each_tensor_goes_to_the_rank_holding_least_so_far():
    # 5 -> r0 (5); 3 -> r1 (3); 3 -> r1 (3 < 5: 6); 1 -> r0 (5 < 6)
    assert greedy_partition([[5, 3, 3, 1]], 2) == [0, 1, 1, 0]


def test_ties_go_to_the_lowest_rank():
    # after 2 -> r0 and 2 -> r1 both hold 2: the third goes to r0, the fourth to r1
    assert greedy_partition([[2, 2, 2, 2]], 2) == [0, 1, 0, 1]
    assert greedy_partition([[1]], 4) == [0]


def test_the_ranks_loads_carry_over_from_one_parameter_group_to_the_next():
    # group 1 puts 4 on r0; group 2's tensors then both go to the emptier r1
    assert greedy_partition([[4], [1, 1]], 2) == [0, 1, 1]


def test_largest_first_visits_each_group_by_size_but_reports_owners_in_parameter_order():
    # sizes 1, 5, 3 visited as 5 (r0), 3 (r1), 1 (r1: 3 < 5)
    assert greedy_partition([[1, 5, 3]], 2, largest_first=True) == [1, 0, 1]
    # in order: 1 (r0), 5 (r1), 3 (r0: 1 < 5)
    assert greedy_partition([[1, 5, 3]], 2) == [0, 1, 0]


def test_one_rank_owns_everything_and_more_ranks_than_tensors_leaves_ranks_empty():
    assert greedy_partition([[3, 7], [1]], 1) == [0, 0, 0]
    assert greedy_partition([[3, 2]], 4) == [0, 1]
    assert greedy_partition([], 3) == []


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 9), nn.Linear(9, 2))


def _owners_from(per_rank_groups, params) -> list[int]:
    index = {id(p): i for i, p in enumerate(params)}
    owners = [-1] * len(params)
    for rank, groups in enumerate(per_rank_groups):
        for group in groups:
            for p in group["params"]:
                owners[index[id(p)]] = rank
    return owners


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_greedy_partition_is_fairscale_oss_own_partition(fake_group, world_size):
    """Two parameter groups (weights, then biases, as the optimizer spec makes them)."""
    from fairscale.optim import OSS

    fake_group(world_size)
    net = _net()
    weights = [p for p in net.parameters() if p.dim() == 2]
    biases = [p for p in net.parameters() if p.dim() == 1]
    optimizer = OSS([{"params": weights}, {"params": biases}], optim=torch.optim.Adam, lr=1e-3)
    expected = _owners_from(optimizer.partition_parameters(), weights + biases)
    assert greedy_partition([[p.numel() for p in weights], [p.numel() for p in biases]], world_size) == expected


# ------------------------------------------------------------------ the base memory model
SHAPES = [(3, 4), (5,), ()]  # 12, 5 and 1 elements (a 0-dim parameter holds one)


def test_without_sharding_every_rank_holds_every_state_in_full():
    for rank in range(3):
        held = MemoryModel.resident_numel(None, SHAPES, [0, 1, 2], rank, 3)
        assert held == {"params": 18, "grads": 18, "optimizer": [12, 5, 1]}


def test_owned_keeps_the_sizes_of_the_tensors_the_rank_owns_in_order():
    assert MemoryModel.owned([12, 5, 1, 7], [1, 0, 1, 1], 1) == [12, 1, 7]
    assert MemoryModel.owned([12, 5], [1, 1], 0) == []


def test_the_base_model_gathers_nothing_keeps_no_bucket_and_sets_up_nothing():
    assert MemoryModel.transient_param_numel(None, [10, 10], 5, 4) == 0
    assert MemoryModel.bucket_numel(None, [10, 10], [0, 1], 0, 2) == (0, 0)
    assert MemoryModel.setup_transient_mib(None, None, 4) == 0.0
    assert MemoryModel.partition([[5, 3, 3, 1]], 2) == [0, 1, 1, 0]  # fairscale's rule, in order


def test_the_tensors_optimizer_state_is_every_tensors_in_the_base_model():
    assert MemoryModel.optimizer_numels([12, 5], [1, 1], 0) == [12, 5]
    assert MemoryModel.depth_line_from == 1 and MemoryModel.depth_lines_per_world_size is False
