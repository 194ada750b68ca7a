"""strategies/base.py: the greedy optimizer-state partition (held against fairscale OSS's own),
the default (DDP) memory model, the facts derived from a strategy's flags (sharding level,
checkpoint format, host offload) and the gradient-zeroing rule."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.config import ZeroGrad
from sharded_exp.strategies.base import GradZeroing, Strategy, greedy_partition


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


# ------------------------------------------------------------------ the default memory model (DDP's)
SHAPES = [(3, 4), (5,), ()]  # 12, 5 and 1 elements (a 0-dim parameter holds one)


def test_without_sharding_every_rank_holds_every_state_in_full():
    for rank in range(3):
        held = Strategy.resident_numel(None, SHAPES, [0, 1, 2], rank, 3)
        assert held == {"params": 18, "grads": 18, "optimizer": [12, 5, 1]}


def test_owned_keeps_the_sizes_of_the_tensors_the_rank_owns_in_order():
    assert Strategy.owned([12, 5, 1, 7], [1, 0, 1, 1], 1) == [12, 1, 7]
    assert Strategy.owned([12, 5], [1, 1], 0) == []


def test_the_default_strategy_gathers_nothing_keeps_no_bucket_and_sets_up_nothing():
    assert Strategy.transient_param_numel(None, [10, 10], 5, 4) == 0
    assert Strategy.bucket_numel(None, [10, 10], [0, 1], 0, 2) == (0, 0)
    assert Strategy.setup_transient_mib(None, None, 4) == 0.0
    assert Strategy.partition([[5, 3, 3, 1]], 2) == [0, 1, 1, 0]  # fairscale's rule, in order


# ------------------------------------------------------------------ facts from the flags
def _kind(**flags) -> type[Strategy]:
    return type("Kind", (Strategy,), flags)


def test_the_sharding_level_follows_the_flags_when_not_set():
    assert _kind().sharding_level() == 0
    assert _kind(optimizer_state_sharded=True).sharding_level() == 1
    assert _kind(shards_parameters=True).sharding_level() == 4
    assert _kind(shards_parameters=True, optimizer_state_sharded=True).sharding_level() == 4
    assert _kind(optimizer_state_sharded=True, sharding=2).sharding_level() == 2


def test_checkpoints_are_consolidated_unless_something_is_sharded():
    assert _kind().checkpoint_format_auto() == "consolidated"
    assert _kind(optimizer_state_sharded=True).checkpoint_format_auto() == "dcp"
    assert _kind(shards_parameters=True).checkpoint_format_auto() == "dcp"
    assert _kind(shards_parameters=True, default_checkpoint_format="consolidated").checkpoint_format_auto() == (
        "consolidated"
    )


def test_host_offload_is_the_configs_cpu_offload_and_false_without_one():
    assert Strategy.offloads_to_host(OmegaConf.create({"name": "x"})) is False
    assert Strategy.offloads_to_host(OmegaConf.create({"cpu_offload": True})) is True
    assert Strategy.offloads_to_host(OmegaConf.create({"cpu_offload": False})) is False


# ------------------------------------------------------------------ gradient zeroing
def test_a_strategy_without_a_fixed_rule_applies_the_requested_one():
    for requested in ZeroGrad:
        rule = Strategy.zero_grad_rule(requested)
        assert rule == GradZeroing(requested, requested) and rule.reason == ""


def test_a_fixed_rule_overrides_the_request_and_says_why_only_when_they_differ():
    fixed = _kind(zero_grad_fixed=ZeroGrad.zeros, zero_grad_fixed_reason="because")
    assert fixed.zero_grad_rule(ZeroGrad.free) == GradZeroing(ZeroGrad.free, ZeroGrad.zeros, "because")
    assert fixed.zero_grad_rule(ZeroGrad.zeros) == GradZeroing(ZeroGrad.zeros, ZeroGrad.zeros, "")


def test_only_the_free_rule_sets_gradients_to_none_and_the_record_names_both_rules():
    assert GradZeroing(ZeroGrad.zeros, ZeroGrad.free).set_to_none is True
    assert GradZeroing(ZeroGrad.free, ZeroGrad.zeros).set_to_none is False
    assert GradZeroing(ZeroGrad.free, ZeroGrad.zeros, "why").record() == {
        "requested": "free", "applied": "zeros", "reason": "why"
    }
    assert GradZeroing(ZeroGrad.zeros, ZeroGrad.zeros).record()["reason"] is None


def test_the_local_shard_without_sharding_is_every_trainable_parameter():
    net = _net()
    net[0].weight.requires_grad_(False)
    strategy = Strategy.__new__(Strategy)
    strategy.module = net
    assert [id(p) for p in strategy.local_shard()] == [id(p) for p in net.parameters() if p is not net[0].weight]


def test_gathering_unsharded_optimizer_state_on_one_rank_copies_it_to_the_cpu(gloo_group):
    strategy = Strategy.__new__(Strategy)
    exp_avg = torch.arange(4.0)
    out = strategy.gather_optimizer_state({"w": {"exp_avg": exp_avg}}, {"w": nn.Parameter(torch.zeros(4))})
    assert torch.equal(out["w"]["exp_avg"], exp_avg) and out["w"]["exp_avg"] is not exp_avg
