"""strategies/__init__.py: the registry lookup, strategies ordered by how much they shard,
the host-offload question by config, and build_strategy's zeroing rule."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sharded_exp.config import ZeroGrad
from sharded_exp.errors import ConfigError
from sharded_exp.strategies import (
    STRATEGIES,
    baseline,
    build_strategy,
    by_sharding,
    memory_of,
    name_of_wrapper,
    offloads_to_host,
    sharding_order,
    traits_of,
)
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
    assert traits_of(name).sharding == level


def test_strategies_are_ordered_least_sharded_first_by_name_among_equals_unknown_last():
    names = ["fsdp", "unknown", "zero1", "ddp", "sharded_ddp", "oss", "fsdp_grad_op", "aaa"]
    assert by_sharding(names) == ["ddp", "oss", "zero1", "sharded_ddp", "fsdp_grad_op", "fsdp", "aaa", "unknown"]


@pytest.mark.parametrize("name, fmt", [
    ("ddp", "consolidated"), ("oss", "dcp"), ("zero1", "dcp"), ("sharded_ddp", "dcp"),
    ("fsdp_grad_op", "dcp"), ("fsdp", "dcp"),
])  # fmt: skip
def test_checkpoints_default_to_dcp_wherever_something_is_sharded(name, fmt):
    assert STRATEGIES.builder(name).traits.checkpoint_format_auto == fmt


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


def test_the_traits_and_memory_model_of_a_name_are_its_classes_parts():
    for name, (cls, _) in EXPECTED.items():
        assert traits_of(name) is cls.traits and memory_of(name) is cls.memory
    with pytest.raises(ConfigError, match="unknown strategy 'zero9'"):
        traits_of("zero9")


def test_an_unregistered_name_sorts_after_every_registered_one():
    assert sharding_order("fsdp") == (4, "fsdp") and sharding_order("zz_plugin") == (99, "zz_plugin")


def test_the_baseline_is_the_one_strategy_that_shards_nothing():
    assert baseline() == "ddp"
    assert [n for n in STRATEGIES.names() if traits_of(n).baseline] == [baseline()]


def _named(name: str, module: str, base: type):
    """A class called ``name`` that says it was defined in ``module`` (a wrapper's stand-in)."""
    return type(name, (base,), {"__module__": module})


def test_a_wrapper_is_found_by_its_dotted_name_and_the_most_sharded_strategy_wins():
    import torch
    from torch import nn

    net = nn.Linear(2, 2)
    assert name_of_wrapper(net, torch.optim.SGD(net.parameters(), lr=0.1)) == (None, None)
    oss = _named("OSS", "fairscale.optim.oss", torch.optim.SGD)(net.parameters(), lr=0.1)
    assert name_of_wrapper(net, oss) == ("oss", None)
    # the same class name from another package is no wrapper
    mine = _named("OSS", "my_project.optim", torch.optim.SGD)(net.parameters(), lr=0.1)
    assert name_of_wrapper(net, mine) == (None, None)
    # ShardedDataParallel over OSS: sharded_ddp (2) over oss (1)
    sdp = _named("ShardedDataParallel", "fairscale.nn.data_parallel.sharded_ddp", nn.Module)()
    sdp.inner = net
    assert name_of_wrapper(sdp, oss) == ("sharded_ddp", None)


@pytest.mark.parametrize("how, expected", [
    ("FULL_SHARD", "fsdp"), ("SHARD_GRAD_OP", "fsdp_grad_op"), ("NO_SHARD", "ddp"),
    ("_HYBRID_SHARD_ZERO2", "fsdp_grad_op"), ("HYBRID_SHARD", "fsdp"),
])  # fmt: skip
def test_fsdp1s_sharding_strategy_picks_among_the_strategies_that_list_it(how, expected):
    from torch import nn

    inner = _named("FullyShardedDataParallel", "torch.distributed.fsdp.fully_sharded_data_parallel", nn.Module)()
    inner.sharding_strategy = f"ShardingStrategy.{how}"
    assert name_of_wrapper(nn.Sequential(inner)) == (expected, how)


def _string_literals(path) -> list[tuple[int, str]]:
    """Every string constant the module's code uses (line, value): docstrings and other bare
    string statements (attribute docstrings) left out, and a dict's keys (a record's field
    named after a framework's own setting, as the HF Trainer's ``fsdp``); f-strings'
    constant parts kept."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    bare = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    bare |= {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys if key is not None}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare]  # fmt: skip


def test_no_module_outside_the_strategies_spells_a_registered_strategys_name():
    """Strategy facts live with the strategies: everything else asks the registry
    (``baseline()``, ``by_sharding``, ``traits_of``, ``name_of_wrapper``)."""
    from pathlib import Path

    import sharded_exp

    root = Path(sharded_exp.__file__).parent
    names = set(STRATEGIES.names())
    found = [
        f"{path.relative_to(root.parent)}:{line}: {value!r}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] not in ("strategies", "conf", "docs")
        for line, value in _string_literals(path)
        if value in names
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_a_strategys_packages_are_its_configs_so_the_command_line_holds_them_too(name):
    builder = STRATEGIES.builder(name)
    assert builder.traits.requires == tuple(getattr(builder.Config, "REQUIRES", ())), name
