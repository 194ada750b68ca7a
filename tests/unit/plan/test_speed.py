"""The planner's speed columns: which machine they are for."""

from __future__ import annotations

import pytest
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


def test_remeasure_measures_once_per_plan_at_each_world_sizes_threads(monkeypatch):
    """plan.remeasure=true: one measurement per thread count before the points, then the points
    read the cache (remeasure off in the config they are planned with)."""
    calls = []
    monkeypatch.setattr(speed, "this_figures", lambda threads, remeasure=False: calls.append((threads, remeasure)))
    monkeypatch.setattr(speed.os, "cpu_count", lambda: 8)
    cfg = plan(device="cpu", remeasure=True, world_sizes=[2, 4, 8, 16])
    out = speed.measured_once(cfg)
    assert calls == [(1, True), (2, True), (4, True)]  # 8 cores: 4, 2, 1 and 1 thread(s) per rank
    assert out.plan.remeasure is False and cfg.plan.remeasure is True  # the caller's config is left as it was
    calls.clear()
    assert speed.measured_once(out) is out  # measured already: read where the cache lacks it, before the points
    assert calls == [(1, False), (2, False), (4, False)]
    calls.clear()
    assert speed.measured_once(plan(remeasure=True, world_sizes=[2])).plan.remeasure
    assert calls == []  # a named profile (h100_sxm): nothing to measure


def test_the_machine_at_hand_prices_a_cpu_point_and_a_named_gpu_states_its_host(monkeypatch):
    """The CPU's ``this`` machine has no host memory for offload (a CPU plans none) and its
    fabric is built (a regression: a float in the host-memory field broke every CPU point);
    a named GPU's carries its server's host memory."""
    from sharded_exp.speed.profiles import load_link

    h100 = speed.load_device("h100_sxm")
    monkeypatch.setattr(speed, "this_profile", lambda threads, remeasure=False: (h100, load_link("pcie4")))
    m = speed.machine(plan(device="cpu"), 2)
    assert m.host_memory is None and m.shared_cores
    assert m.fabric(2, 10**6).host_memory_Bps is None
    named = speed.machine(plan(device_profile="h100_sxm"), 8)
    assert named.fabric(8, 10**6).host_memory_Bps == pytest.approx((70.4e9 * 2 / 3, 70.4e9))


def test_this_gpu_is_measured_and_linked_as_its_sourced_profile_states(monkeypatch):
    """plan.device_profile=this for a CUDA plan: the GPU at hand, measured once before the
    points (its figures in the cache), NVLink inside a node as the sourced profile of its name
    states, the network between nodes, the host link measured; not the CPU."""
    from dataclasses import replace

    measured = replace(speed.load_device("h100_sxm"), name="this", title="this machine (NVIDIA H100 80GB HBM3)")
    calls = []
    monkeypatch.setattr(speed, "this_cuda_profile", lambda remeasure=False: measured)
    monkeypatch.setattr(speed, "this_cuda_host_link", lambda remeasure=False: None)
    monkeypatch.setattr(speed, "this_profile", lambda *a, **k: pytest.fail("a CUDA plan priced on the CPU"))
    monkeypatch.setattr(speed, "this_figures", lambda *a, **k: calls.append(a))
    cfg = plan(device_profile="this", inter_node_gbps=200, remeasure=True, world_sizes=[8, 16])
    assert speed.measured_once(cfg).plan.remeasure is False and calls == [(1, True, "cuda")]
    m = speed.machine(cfg, 16)
    assert m.device is measured and m.intra.name == "nvlink4" and m.inter.bandwidth_Bps == 25e9
    assert m.gpus_per_node == 8 and not m.shared_cores
    assert "this machine's GPU measured" in speed.describe(cfg)


def test_this_gpu_that_no_profile_names_has_no_link_to_price_its_nodes_collectives(monkeypatch):
    from dataclasses import replace

    unknown = replace(speed.load_device("h100_sxm"), name="this", title="this machine (NVIDIA RTX 6000 Ada Generation)")
    monkeypatch.setattr(speed, "this_cuda_profile", lambda remeasure=False: unknown)
    monkeypatch.setattr(speed, "this_cuda_host_link", lambda remeasure=False: None)
    with pytest.raises(ValueError, match="no sourced link profile for this machine"):
        speed.machine(plan(device_profile="this"), 8)  # said as the row's speed note
    assert speed.machine(plan(device_profile="this"), 1).device is unknown  # one GPU: no link to price
