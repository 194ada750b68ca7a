"""strategies/__init__.py: the registry lookup, strategies ordered by how much they shard,
the host-offload question by config, and build_strategy's zeroing rule."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sharded_exp.config import ZeroGrad
from sharded_exp.errors import ConfigError
from sharded_exp.strategies import STRATEGIES, build_strategy, by_sharding, offloads_to_host, sharding_of
from sharded_exp.strategies.ddp import DDP, DDPConfig
from sharded_exp.strategies.fsdp import FSDP, FSDPConfig, FSDPGradOp, FSDPGradOpConfig
from sharded_exp.strategies.oss import OSS, OSSConfig
from sharded_exp.strategies.sharded_ddp import ShardedDDP, ShardedDDPConfig
from sharded_exp.strategies.zero1 import ZeRO1, ZeRO1Config

EXPECTED = {
    "ddp": (DDP, DDPConfig),
    "oss": (OSS, OSSConfig),
    "zero1": (ZeRO1, ZeRO1Config),
    "sharded_ddp": (ShardedDDP, ShardedDDPConfig),
    "fsdp_grad_op": (FSDPGradOp, FSDPGradOpConfig),
    "fsdp": (FSDP, FSDPConfig),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_name_looks_up_its_class_and_config_whose_default_name_is_that_name(name):
    cls, config = EXPECTED[name]
    assert STRATEGIES.builder(name) is cls and STRATEGIES.config_class(name) is config
    assert config().name == name


def test_an_unknown_strategy_is_a_config_error_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown strategy 'zero9'.*ddp, fsdp, fsdp_grad_op, oss, sharded_ddp"):
        STRATEGIES.builder("zero9")


@pytest.mark.parametrize("name, level", [
    ("ddp", 0), ("oss", 1), ("zero1", 1), ("sharded_ddp", 2), ("fsdp_grad_op", 3), ("fsdp", 4),
])  # fmt: skip
def test_each_strategy_shards_what_its_zero_stage_says(name, level):
    assert sharding_of(name) == level


def test_strategies_are_ordered_least_sharded_first_by_name_among_equals_unknown_last():
    names = ["fsdp", "unknown", "zero1", "ddp", "sharded_ddp", "oss", "fsdp_grad_op", "aaa"]
    assert by_sharding(names) == ["ddp", "oss", "zero1", "sharded_ddp", "fsdp_grad_op", "fsdp", "aaa", "unknown"]


@pytest.mark.parametrize("name, fmt", [
    ("ddp", "consolidated"), ("oss", "dcp"), ("zero1", "dcp"), ("sharded_ddp", "dcp"),
    ("fsdp_grad_op", "dcp"), ("fsdp", "dcp"),
])  # fmt: skip
def test_checkpoints_default_to_dcp_wherever_something_is_sharded(name, fmt):
    assert STRATEGIES.builder(name).checkpoint_format_auto() == fmt


def test_only_fsdp_with_cpu_offload_keeps_states_in_host_memory():
    for name, (_, config) in EXPECTED.items():
        assert offloads_to_host(OmegaConf.structured(config)) is False, name
    assert offloads_to_host(OmegaConf.structured(FSDPConfig(cpu_offload=True))) is True
    assert offloads_to_host(OmegaConf.structured(FSDPGradOpConfig(cpu_offload=True))) is True


@pytest.mark.parametrize("zero_grad, applied", [(None, ZeroGrad.free), (ZeroGrad.zeros, ZeroGrad.zeros)])
def test_build_strategy_applies_the_requested_zeroing_free_when_none_is_asked(gloo_group, zero_grad, applied):
    import torch
    from torch import nn

    from sharded_exp.config import OptimizerConfig, PrecisionConfig
    from sharded_exp.optim import optimizer_spec

    module = nn.Linear(4, 2)
    spec = optimizer_spec(OmegaConf.structured(OptimizerConfig(name="adam")), module)
    strategy = build_strategy(OmegaConf.structured(DDPConfig), module, spec, OmegaConf.structured(PrecisionConfig),
                              torch.device("cpu"), zero_grad)  # fmt: skip
    assert strategy.grad_zeroing.applied is applied and strategy.grad_zeroing.set_to_none is (applied is ZeroGrad.free)
