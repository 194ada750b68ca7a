"""strategies/base.py: the runtime's defaults (DDP's): the local shard, gathering optimizer
state, and the runtime class kept small (its facts live in traits, its rules in memory)."""

from __future__ import annotations

import torch
from torch import nn

from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import Strategy
from sharded_exp.strategies.residency import MemoryModel
from sharded_exp.strategies.timing import TimeModel
from sharded_exp.strategies.traits import Traits


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 9), nn.Linear(9, 2))


def _members(cls: type) -> set[str]:
    """The public names a class adds beyond ``object``'s (its own and its bases')."""
    return {name for name in set(dir(cls)) - set(dir(object)) if not name.startswith("_")}


PARTS = {"Config", "traits", "memory", "timing"}
"""The parts a strategy is made of (its schema, facts, memory model and time model), beside its runtime."""


def test_every_runtime_keeps_to_twelve_public_members_beside_its_parts():
    for name in STRATEGIES.names():
        members = _members(STRATEGIES.builder(name))
        assert PARTS <= members, (name, sorted(members))
        assert len(members - PARTS) <= 12, (name, sorted(members - PARTS))
    assert _members(Strategy) == {
        "Config", "traits", "memory", "timing", "check", "build", "zero_grad", "no_sync", "clip_grad_norm_",
        "optimizer_step", "local_shard", "gather_optimizer_state", "local_optimizers",
    }  # fmt: skip


def test_the_runtimes_parts_are_frozen_traits_a_memory_model_and_a_time_model():
    for name in STRATEGIES.names():
        cls = STRATEGIES.builder(name)
        assert isinstance(cls.traits, Traits) and issubclass(cls.memory, MemoryModel)
        assert issubclass(cls.timing, TimeModel)


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
