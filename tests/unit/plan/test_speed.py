"""The planner's speed columns: which machine they are for."""

from __future__ import annotations

from omegaconf import OmegaConf

from sharded_exp.plan import speed


def plan(**settings):
    base = {"device": "cuda", "device_profile": None, "gpus_per_node": 8, "inter_node_gbps": 100.0}
    return OmegaConf.create({"plan": base | settings})


def test_the_default_profile_follows_the_device_and_the_header_says_it_is_the_default():
    assert speed.profile_name(plan()) == "h100_sxm" and speed.profile_name(plan(device="cpu")) == "this"
    assert "profile h100_sxm (the default for plan.device=cuda)" in speed.describe(plan())
    line = speed.describe(plan(device_profile="v100_32gb", gpus_per_node=4, inter_node_gbps=25))
    assert "(the default" not in line and "nvlink2 within nodes of 4 GPUs, 25 Gb/s per GPU" in line


def test_a_named_machine_has_its_nvlink_inside_nodes_and_the_network_between():
    m = speed.machine(plan(device_profile="a100_80gb", inter_node_gbps=200), 16)
    assert m.intra.name == "nvlink3" and m.inter.bandwidth_Bps == 25e9 and m.gpus_per_node == 8
    assert m.host.name == "pcie4"
