"""Each strategy's time model: its collectives, their dtype and how they overlap."""

from __future__ import annotations

import mmap

import pytest

from sharded_exp.speed.collectives import Link, Topology
from sharded_exp.speed.schedule import HostStepBytes, Units, simulate
from sharded_exp.strategies import STRATEGIES, timing_of
from sharded_exp.strategies.timing import Fabric, TimeUnknown

LINK = Link("test", bandwidth_Bps=1e9)
UNITS = Units(forward_s=[0.01] * 4, backward_s=[0.02] * 4, param_bytes=[4e6] * 4, optimizer_s=0.005)


def fabric(world_size=8, per_node=8, **kw):
    return Fabric(world_size, Topology(per_node, LINK, Link("net", bandwidth_Bps=1e8)), **kw)


def played(name, world_size=8, **settings):
    cfg = STRATEGIES.config_class(name)()
    for key, value in settings.items():
        setattr(cfg, key, value)
    model, f = timing_of(name), fabric(world_size)
    return simulate(model.schedule(cfg, UNITS, model.price(cfg, f), f))


def kinds(name, **settings):
    cfg = STRATEGIES.config_class(name)()
    for key, value in settings.items():
        setattr(cfg, key, value)
    model, f = timing_of(name), fabric()
    return {e.kind for e in model.schedule(cfg, UNITS, model.price(cfg, f), f).events}


def test_each_strategy_issues_its_own_collectives():
    assert kinds("ddp") == {"all_reduce"}
    assert kinds("zero1") == kinds("oss") == {"all_reduce", "broadcast"}
    assert kinds("sharded_ddp") == {"reduce", "broadcast"}
    assert kinds("fsdp") == kinds("fsdp_grad_op") == {"all_gather", "reduce_scatter"}


def test_one_rank_communicates_nothing_and_its_step_is_its_compute():
    for name in STRATEGIES.names():
        out = played(name, world_size=1)
        assert out.exposed_s == pytest.approx(0.0, abs=1e-12) and out.step_time_s == pytest.approx(0.125), name


def test_fsdp_without_resharding_gathers_less_than_with():
    assert played("fsdp_grad_op").comm_s < played("fsdp").comm_s


def test_hsdp_prices_the_replicas_all_reduce_across_nodes():
    cfg = STRATEGIES.config_class("fsdp")()
    flat = timing_of("fsdp").price(cfg, fabric(16))
    cfg.replicate = 2
    hsdp = timing_of("fsdp").price(cfg, fabric(16))
    # HSDP's gathers stay inside a node; the flat group's cross the slower network
    assert hsdp("all_gather", 4e6) < flat("all_gather", 4e6)


def test_parameters_travel_in_the_compute_dtype_under_fsdp_and_gradients_in_float32():
    cfg = STRATEGIES.config_class("fsdp")()
    assert timing_of("fsdp").param_bytes_per_element(cfg, "bf16", 4.0) == 2.0
    assert timing_of("fsdp").grad_bytes_per_element(cfg, "bf16", 4.0) == 4.0
    assert timing_of("ddp").grad_bytes_per_element(STRATEGIES.config_class("ddp")(), "bf16", 4.0) == 4.0


def test_offload_without_the_host_figures_is_unknown_and_says_which():
    cfg = STRATEGIES.config_class("fsdp")()
    cfg.cpu_offload = True
    f = fabric()
    with pytest.raises(TimeUnknown, match="host link"):
        timing_of("fsdp").schedule(cfg, UNITS, timing_of("fsdp").price(cfg, f), f)
    f = fabric(pcie_Bps=1e9, host_memory_Bps=(1e10, 2e10), params=4_000_000)
    with pytest.raises(TimeUnknown, match="optimizer's bytes per element"):
        timing_of("fsdp").schedule(cfg, UNITS, timing_of("fsdp").price(cfg, f), f)
    moved = HostStepBytes(in_place=60, out_of_place=16)
    f = fabric(pcie_Bps=1e9, host_memory_Bps=(1e10, 2e10), params=4_000_000, host_step_bytes=moved)
    events = timing_of("fsdp").schedule(cfg, UNITS, timing_of("fsdp").price(cfg, f), f).events
    assert {"h2d", "d2h", "host_step"} <= {e.kind for e in events}
    # the rank's shard of 4e6 elements (a world of 8, the fabric's default): 60 B each in place
    # at 20 GB/s, 16 at a copy's 10
    assert next(e.seconds for e in events if e.kind == "host_step") == pytest.approx(5e5 * (60 / 2e10 + 16 / 1e10))
    # two tensors at 8 ranks: 1.6e8 elements is a 2e7-element fp32 shard (76 MiB, mapped anew by
    # glibc each step), 1.6e7 a 7.6 MiB one (from the heap); 4 new bytes an element, 1 us a page
    f = fabric(pcie_Bps=1e9, host_memory_Bps=(1e10, 2e10), params=4_000_000,
               host_step_bytes=HostStepBytes(60, 16, new_tensors=4), tensor_elements=(1.6e8, 1.6e7), fresh_page_s=1e-6)  # fmt: skip
    events = timing_of("fsdp").schedule(cfg, UNITS, timing_of("fsdp").price(cfg, f), f).events
    pages = 2e7 * 4 / mmap.PAGESIZE
    expected = 5e5 * (60 / 2e10 + 16 / 1e10) + pages * 1e-6
    assert next(e.seconds for e in events if e.kind == "host_step") == pytest.approx(expected)


def test_zero1_broadcasts_tensor_by_tensor_unless_its_parameters_are_a_bucket_view():
    """ZeroRedundancyOptimizer's default sends each parameter tensor in a call of its own (each
    pays the link's latency); with parameters_as_bucket_view, one flat buffer per rank, as OSS."""
    units = Units([0.01] * 4, [0.02] * 4, [4e6] * 4, optimizer_s=0.005, tensor_bytes=[1e6] * 16)
    f = fabric()

    def broadcasts(name, **settings):
        cfg = STRATEGIES.config_class(name)()
        for key, value in settings.items():
            setattr(cfg, key, value)
        model = timing_of(name)
        return [e for e in model.schedule(cfg, units, model.price(cfg, f), f).events if e.kind == "broadcast"]

    assert len(broadcasts("zero1")) == 16 and sum(e.nbytes for e in broadcasts("zero1")) == 16e6
    assert len(broadcasts("zero1", parameters_as_bucket_view=True)) == len(broadcasts("oss")) == 8
    per_tensor = sum(e.seconds for e in broadcasts("zero1"))
    assert per_tensor > sum(e.seconds for e in broadcasts("zero1", parameters_as_bucket_view=True))


def test_at_world_size_1_each_call_costs_what_the_link_states_except_fsdp2s():
    """A gloo link measured alone (20 us a call): ZeRO-1 broadcasts each of its 3 tensors after
    the step, ShardedDDP reduces each (no buckets for one rank), DDP all-reduces its one
    bucket; FSDP2's calls are in its measured host cost per op, so priced at 0."""
    solo = Link("gloo", bandwidth_Bps=1e9, solo_call_s={k: 20e-6 for k in ("all_reduce", "broadcast", "reduce",
                                                                            "all_gather", "reduce_scatter")})  # fmt: skip
    units = Units([0.01] * 2, [0.02] * 2, [8e3, 4e3], tensor_bytes=[4e3, 4e3, 4e3], tensors_per_unit=[2, 1],
                  optimizer_s=0.005)  # fmt: skip
    one = Fabric(1, Topology(1, solo))

    def comm(name):
        cfg, model = STRATEGIES.config_class(name)(), timing_of(name)
        events = model.schedule(cfg, units, model.price(cfg, one), one).events
        return sorted(e.kind for e in events), sum(e.seconds for e in events)

    assert comm("zero1") == (["all_reduce", "broadcast", "broadcast", "broadcast"], pytest.approx(80e-6))
    assert comm("sharded_ddp") == (["broadcast", "reduce", "reduce", "reduce"], pytest.approx(80e-6))
    assert comm("ddp") == (["all_reduce"], pytest.approx(20e-6))
    fsdp_kinds, fsdp_seconds = comm("fsdp")
    assert "all_gather" in fsdp_kinds and fsdp_seconds == 0.0
