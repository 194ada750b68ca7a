"""strategies/traits.py: the facts derived from a strategy's traits (checkpoint format, host
offload), the gradient-zeroing rule, and how a wrapper class is recognised by its dotted name."""

from __future__ import annotations

from omegaconf import OmegaConf

from sharded_exp.config import ZeroGrad
from sharded_exp.strategies.traits import GradZeroing, Traits, defines, wrapped_by


def test_traits_are_frozen():
    import dataclasses

    import pytest

    with pytest.raises(dataclasses.FrozenInstanceError):
        Traits().sharding = 3


def test_checkpoints_are_consolidated_unless_something_is_sharded():
    assert Traits().checkpoint_format_auto == "consolidated"
    assert Traits(optimizer_state_sharded=True).checkpoint_format_auto == "dcp"
    assert Traits(shards_parameters=True).checkpoint_format_auto == "dcp"
    assert Traits(shards_parameters=True, checkpoint_format="consolidated").checkpoint_format_auto == "consolidated"


def test_host_offload_is_the_named_setting_and_false_without_one():
    offloading = Traits(host_offload="cpu_offload")
    assert offloading.offloads_to_host(OmegaConf.create({"name": "x"})) is False
    assert offloading.offloads_to_host(OmegaConf.create({"cpu_offload": True})) is True
    assert offloading.offloads_to_host(OmegaConf.create({"cpu_offload": False})) is False
    assert Traits().offloads_to_host(OmegaConf.create({"cpu_offload": True})) is False


# ------------------------------------------------------------------ gradient zeroing
def test_a_strategy_without_a_fixed_rule_applies_the_requested_one():
    for requested in ZeroGrad:
        rule = Traits().zero_grad_rule(requested)
        assert rule == GradZeroing(requested, requested) and rule.reason == ""


def test_a_fixed_rule_overrides_the_request_and_says_why_only_when_they_differ():
    fixed = Traits(zero_grad_fixed=ZeroGrad.zeros, zero_grad_fixed_reason="because")
    assert fixed.zero_grad_rule(ZeroGrad.free) == GradZeroing(ZeroGrad.free, ZeroGrad.zeros, "because")
    assert fixed.zero_grad_rule(ZeroGrad.zeros) == GradZeroing(ZeroGrad.zeros, ZeroGrad.zeros, "")


def test_only_the_free_rule_sets_gradients_to_none_and_the_record_names_both_rules():
    assert GradZeroing(ZeroGrad.zeros, ZeroGrad.free).set_to_none is True
    assert GradZeroing(ZeroGrad.free, ZeroGrad.zeros).set_to_none is False
    assert GradZeroing(ZeroGrad.free, ZeroGrad.zeros, "why").record() == {
        "requested": "free",
        "applied": "zeros",
        "reason": "why",
    }
    assert GradZeroing(ZeroGrad.zeros, ZeroGrad.zeros).record()["reason"] is None


def _named(name: str, module: str) -> type:
    return type(name, (), {"__module__": module})


def test_a_class_is_the_wrapper_its_package_exports_under_that_name():
    assert defines(_named("OSS", "fairscale.optim.oss"), "fairscale.optim.OSS")
    assert defines(_named("OSS", "fairscale.optim"), "fairscale.optim.OSS")
    assert not defines(_named("OSS", "fairscale.optimx"), "fairscale.optim.OSS")
    assert not defines(_named("OSS2", "fairscale.optim.oss"), "fairscale.optim.OSS")


def test_a_wrapper_with_a_value_matches_only_that_sharding_strategy():
    traits = Traits(wrappers=("a.b.Wrap:SHARD_GRAD_OP", "a.b.Other"))
    wrap, other = _named("Wrap", "a.b.c"), _named("Other", "a.b")
    assert wrapped_by(traits, [wrap], "SHARD_GRAD_OP") == "a.b.Wrap:SHARD_GRAD_OP"
    assert wrapped_by(traits, [wrap], "FULL_SHARD") is None
    assert wrapped_by(traits, [wrap, other], "FULL_SHARD") == "a.b.Other"
    assert wrapped_by(Traits(), [wrap], None) is None
