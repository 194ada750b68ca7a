"""Collective costs against numbers worked by hand from nccl-tests' formulas and NCCL's
latency model (``sharded_exp.speed.collectives``' docstring)."""

from __future__ import annotations

import pytest

from sharded_exp.errors import ConfigError
from sharded_exp.speed.collectives import (
    Link,
    Topology,
    bus_factor,
    collective_time,
    group_time,
    hsdp_gradient_time,
    pricer,
    ring_steps,
)
from sharded_exp.speed.profiles import load_link, network_link

GIB = 2**30
FAST = Link("100GBps", bandwidth_Bps=100e9)  # no per-step latency: bandwidth + NCCL's 8.4 us ring base
BASE = 8.4e-6


def test_ring_all_reduce_of_1_gib_on_8_ranks_at_100_gb_s():
    """S = 2^30 B, factor 2 (8 - 1) / 8 = 1.75: 1.75 * 1,073,741,824 / 1e11 = 18.7905 ms,
    plus NCCL's ring base latency, 8.4 us: 18.7989 ms."""
    assert collective_time("all_reduce", GIB, 8, FAST) == pytest.approx(0.0187905 + BASE, rel=1e-5)


def test_the_ring_latency_is_the_base_plus_one_per_step():
    """All-reduce on 8 ranks: 2 (8 - 1) = 14 steps; 8.4 us + 14 * 5 us = 78.4 us."""
    slow = Link("lat", bandwidth_Bps=100e9, ring_step_latency_s=5e-6)
    assert collective_time("all_reduce", 8, 8, slow) - collective_time("all_reduce", 8, 8, FAST) == pytest.approx(
        14 * 5e-6, rel=1e-6
    )
    assert collective_time("all_reduce", 8, 8, slow) == pytest.approx(8.4e-6 + 14 * 5e-6 + 8 * 1.75 / 100e9)


def test_all_gather_reduce_scatter_broadcast_and_reduce_use_nccl_tests_factors():
    """(n - 1)/n = 0.875 for all-gather and reduce-scatter: 9.3952 ms; 1 for broadcast and
    reduce: 2^30 / 1e11 = 10.7374 ms (each + 8.4 us)."""
    for kind in ("all_gather", "reduce_scatter"):
        assert collective_time(kind, GIB, 8, FAST) == pytest.approx(0.0093952 + BASE, rel=1e-5)
    for kind in ("broadcast", "reduce"):
        assert collective_time(kind, GIB, 8, FAST) == pytest.approx(0.0107374 + BASE, rel=1e-5)
    assert [bus_factor(k, 4) for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")] == [
        1.5, 0.75, 0.75, 1.0, 1.0]  # fmt: skip
    assert [ring_steps(k, 4) for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")] == [
        6, 3, 3, 4, 4]  # fmt: skip


def test_a_gloo_link_prices_a_reduce_scatter_as_the_all_reduce_gloo_runs():
    """gloo runs a reduce-scatter as an all-reduce of the whole input: on 2 ranks, 1 GiB at
    100 GB/s and 5 us a step, 2 (2 - 1) / 2 * 2^30 / 1e11 = 10.7374 ms and 2 steps (8.4 + 10
    us), where NCCL's reduce-scatter moves half of that in one step (5.3687 ms, 8.4 + 5 us)."""
    nccl = Link("nvlink", bandwidth_Bps=100e9, ring_step_latency_s=5e-6)
    gloo = Link("gloo", bandwidth_Bps=100e9, ring_step_latency_s=5e-6, reduce_scatter_as_all_reduce=True)
    assert collective_time("reduce_scatter", GIB, 2, nccl) == pytest.approx(0.0053687 + BASE + 5e-6, rel=1e-4)
    assert collective_time("reduce_scatter", GIB, 2, gloo) == pytest.approx(0.0107374 + BASE + 10e-6, rel=1e-4)
    assert collective_time("reduce_scatter", GIB, 2, gloo) == collective_time("all_reduce", GIB, 2, gloo)
    assert collective_time("all_gather", GIB, 2, gloo) == collective_time("all_gather", GIB, 2, nccl)
    with pytest.raises(ConfigError, match="ring only"):  # asked as NCCL would be: refused before gloo's rule
        collective_time("reduce_scatter", GIB, 2, gloo, algorithm="tree")
    # HSDP on gloo (2 replicas of 2): the shard level's reduce-scatter is gloo's all-reduce too
    flat = Topology(4, gloo)
    shard, replicate = hsdp_gradient_time(GIB, 2, 2, flat)
    assert shard == pytest.approx(collective_time("all_reduce", GIB, 2, gloo))
    assert replicate == pytest.approx(group_time("all_reduce", GIB / 2, 2, flat, stride=2))


def test_tree_all_reduce_is_priced_as_nccl_does():
    """Half the bus bandwidth: 2 * 2^30 / 1e11 = 21.475 ms; one node of 8: latency
    2 * (8 - 1) * 28 us = 392 us."""
    tree = Link("t", bandwidth_Bps=100e9, tree_step_latency_s=28e-6)
    assert collective_time("all_reduce", GIB, 8, tree, algorithm="tree") == pytest.approx(0.021475 + 392e-6, rel=1e-4)
    with pytest.raises(ConfigError, match="ring only"):
        collective_time("all_gather", GIB, 8, tree, algorithm="tree")


def test_one_rank_or_no_bytes_cost_nothing_and_bad_arguments_are_refused():
    assert collective_time("all_reduce", GIB, 1, FAST) == 0.0
    assert collective_time("all_reduce", 0, 8, FAST) == 0.0
    with pytest.raises(ConfigError, match="all_to_all"):
        collective_time("all_to_all", GIB, 8, FAST)
    with pytest.raises(ConfigError, match="algorithm"):
        collective_time("all_reduce", GIB, 8, FAST, algorithm="butterfly")


def test_a_flat_group_spanning_nodes_leaves_each_node_through_every_nic():
    """16 ranks on 2 nodes of 8 over 100 Gb/s (12.5 GB/s) per GPU: NCCL's 8 channels leave a
    node through its 8 NICs (busBw = nChannels x bw), 100 GB/s, below NVLink 4's 369.9 (450 at
    NCCL's 0.822):
    2 * 15/16 = 1.875; 1.875 * 2^30 / 100e9 = 20.13 ms. Latency: 30 steps, 2 (2 - 1) = 2
    cross nodes: 8.4 + 28 * 3.4 + 2 * 9.6 = 122.8 us."""
    topo = Topology(8, load_link("nvlink4"), network_link(100))
    assert group_time("all_reduce", GIB, 16, topo) == pytest.approx(1.875 * GIB / 100e9 + 122.8e-6, rel=1e-4)
    assert group_time("all_reduce", GIB, 8, topo) == pytest.approx(1.75 * GIB / 369.9e9 + 8.4e-6 + 14 * 3.4e-6)
    # a fast network: the node's NICs together outrun NVLink, which then bounds the ring
    fast = Topology(8, load_link("nvlink4"), network_link(800))  # 8 x 100 GB/s > 369.9 GB/s
    assert group_time("all_gather", GIB, 16, fast) > 15 / 16 * GIB / 369.9e9
    with pytest.raises(ConfigError, match="no inter-node link"):
        group_time("all_reduce", GIB, 16, Topology(8, FAST))


def test_a_group_spread_unevenly_over_nodes_leaves_the_emptier_node_through_its_own_nics():
    """12 ranks at 8 a node over 100 Gb/s (12.5 GB/s) per GPU: the second node holds 4, and every
    channel's ring passes through it, so 4 NICs carry the ring there: 50 GB/s, not the mean's 6 x
    12.5 = 75. Ring all-reduce of 1 GiB: 2 * 11/12 * 2^30 / 50e9 = 39.37 ms; latency 22 steps, 2
    across nodes: 8.4 + 20 * 3.4 + 2 * 9.6 = 95.6 us. A tree's depth is the fuller node's 8 ranks:
    the same latency as 16 ranks on two full nodes, its bandwidth 2 * 2^30 / 50e9."""
    topo = Topology(8, load_link("nvlink4"), network_link(100))
    assert group_time("all_reduce", GIB, 12, topo) == pytest.approx(2 * 11 / 12 * GIB / 50e9 + 95.6e-6, rel=1e-4)
    tree_12 = group_time("all_reduce", GIB, 12, topo, algorithm="tree") - 2 * GIB / 50e9
    tree_16 = group_time("all_reduce", GIB, 16, topo, algorithm="tree") - 2 * GIB / 100e9
    assert tree_12 == pytest.approx(tree_16)


def test_hsdp_prices_its_two_levels_apart():
    """2 nodes of 8, shard 8 (in a node, NVLink 4: 450 GB/s at NCCL's 0.822, 369.9), replicate 2
    (across, 12.5 GB/s), 1 GiB of gradients: reduce-scatter 0.875 * 2^30 / 369.9e9 = 2.540 ms
    (+ 8.4 + 7 * 3.4 us);
    all-reduce of 2^30 / 8 = 128 MiB between 2 replicas: factor 1, 134,217,728 / 12.5e9 =
    10.737 ms (+ 8.4 + 2 * 9.6 us): a replicate group has one rank a node, so one NIC. A flat
    all-reduce of the same over 16 ranks (8 NICs a node): 20.1 ms."""
    topo = Topology(8, load_link("nvlink4"), network_link(100))
    reduce_scatter, all_reduce = hsdp_gradient_time(GIB, shard=8, replicate=2, topology=topo)
    assert reduce_scatter == pytest.approx(0.875 * GIB / 369.9e9 + 8.4e-6 + 7 * 3.4e-6)
    assert all_reduce == pytest.approx(GIB / 8 / 12.5e9 + 8.4e-6 + 2 * 9.6e-6)
    assert reduce_scatter + all_reduce < group_time("all_reduce", GIB, 16, topo)


def test_the_pricer_prices_a_flat_group_for_the_schedules():
    price = pricer(8, Topology(8, FAST))
    assert price("all_reduce", GIB) == pytest.approx(0.0187905 + BASE, rel=1e-5)
    assert price("broadcast", GIB) == pytest.approx(0.0107374 + BASE, rel=1e-5)


def test_one_rank_costs_its_call_where_the_link_states_it():
    """A world of one moves nothing: gloo still makes a work object and waits on it, which the
    ``this`` link measures per kind; a link stating nothing prices it at 0."""
    solo = Link("gloo", bandwidth_Bps=1e9, ring_step_latency_s=1e-4, reduce_scatter_as_all_reduce=True,
                solo_call_s={"broadcast": 24e-6, "reduce_scatter": 36e-6, "all_reduce": 25e-6})  # fmt: skip
    assert collective_time("broadcast", GIB, 1, solo) == 24e-6  # whatever the size
    assert collective_time("broadcast", 4, 1, solo) == 24e-6
    assert collective_time("reduce_scatter", GIB, 1, solo) == 36e-6  # its own call, not the all-reduce's
    assert collective_time("all_gather", GIB, 1, solo) == 0.0  # not stated
    assert collective_time("broadcast", 0, 1, solo) == 0.0  # no tensor, no call
    # two ranks: the link's price (NCCL's base, two steps of latency, the bytes), no call on top
    assert collective_time("broadcast", 4, 2, solo) == pytest.approx(8.4e-6 + 2 * 1e-4 + 4 / 1e9)
    with pytest.raises(ConfigError, match=">= 0 bytes"):
        collective_time("broadcast", -1, 1, solo)


def test_a_kinds_measured_call_between_two_ranks_is_its_latency_scaled_by_its_steps():
    """gloo's kinds are different algorithms: a link that states each kind's small call between
    two ranks prices that call as the latency, times the kind's ring steps at n ranks over its
    steps at two; a kind it does not state keeps the per-step latency."""
    gloo = Link("gloo", bandwidth_Bps=1e9, ring_step_latency_s=4e-4, reduce_scatter_as_all_reduce=True,
                pair_call_s={"broadcast": 8e-5, "all_reduce": 9e-4, "all_gather": 1.5e-4})  # fmt: skip
    assert collective_time("broadcast", 1e6, 2, gloo) == pytest.approx(8e-5 + 1e6 / 1e9)
    assert collective_time("all_reduce", 1e6, 2, gloo) == pytest.approx(9e-4 + 1e6 / 1e9)  # 2 (n-1)/n = 1
    # 4 ranks: broadcast 4 steps against 2, all-reduce 6 against 2, all-gather 3 against 1
    assert collective_time("broadcast", 1e6, 4, gloo) == pytest.approx(2 * 8e-5 + 1e6 / 1e9)
    assert collective_time("all_reduce", 1e6, 4, gloo) == pytest.approx(3 * 9e-4 + 1.5 * 1e6 / 1e9)
    assert collective_time("all_gather", 1e6, 4, gloo) == pytest.approx(3 * 1.5e-4 + 0.75 * 1e6 / 1e9)
    # gloo's reduce-scatter is its all-reduce, and pays that call
    assert collective_time("reduce_scatter", 1e6, 2, gloo) == collective_time("all_reduce", 1e6, 2, gloo)
    # not stated: NCCL's base and the per-step latency, as before
    assert collective_time("reduce", 1e6, 2, gloo) == pytest.approx(8.4e-6 + 2 * 4e-4 + 1e6 / 1e9)


def test_hsdp_with_shards_of_one_reduces_nothing_in_the_shard_group():
    """replicate = world size: each shard group is one rank, where FSDP2 copies the gradient
    (no reduce-scatter call), then all-reduces it across the replicas."""
    solo = Link("gloo", bandwidth_Bps=1e9, solo_call_s={"reduce_scatter": 1.0, "all_reduce": 1.0})
    reduce_scatter, all_reduce = hsdp_gradient_time(1e6, 1, 2, Topology(2, solo))
    assert reduce_scatter == 0.0 and all_reduce == pytest.approx(8.4e-6 + 1e6 / 1e9)
