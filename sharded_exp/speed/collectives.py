"""What a collective costs: all-reduce, all-gather, reduce-scatter, broadcast and reduce, for
n ranks, a size in bytes, on a link, by ring or tree, as NCCL documents and models them.

Bandwidth term (nccl-tests, ``doc/PERFORMANCE.md``, "Bus bandwidth",
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): with ``B`` the bandwidth
each rank has "to the outside world" (one direction) and ``S`` the size of the whole array,
the best time is ``S / B * factor``:

====================  ==================  =============================================
collective            factor              S is
====================  ==================  =============================================
all_reduce            2 (n - 1) / n       the buffer
reduce_scatter        (n - 1) / n         the whole input (``recvcount * n`` elements)
all_gather            (n - 1) / n         the whole output (``sendcount * n`` elements)
broadcast, reduce     1                   the buffer (all of it leaves or reaches the root)
====================  ==================  =============================================

"this is independent of the algorithm used (ring, tree, or other) as long as they use
point-to-point operations" for all-reduce; NCCL's own cost model (``src/graph/tuning.cc``,
``ncclTopoTuneModel``) nevertheless prices its tree all-reduce at half the bus bandwidth
(``ratio = .5``: time ``2 S / B``) and its ring at ``n / nsteps`` of it, which is the factor
above. Tree is NCCL's algorithm for all-reduce only; the other four are ring-only there, and
asking for their tree is refused.

Latency term, where the link states what a small call of each kind costs between two of its
ranks (``pair_call_s``: measured for a CPU's local gloo link, whose kinds are different
algorithms): that call, times the kind's ring steps at n ranks over its steps at two.
Otherwise (the same ``tuning.cc``, Simple protocol, the one used for large messages):
a ring pays a base latency (``baseLat``: 8.4 us) plus one per-step latency (``hwLat``: the
link's) per step, ``nsteps`` = 2 (n - 1) for all-reduce, n - 1 for all-gather and
reduce-scatter, n for broadcast and reduce; steps that cross nodes (``nInterSteps`` =
2 (nodes - 1), nodes - 1, nodes) pay the network's latency, the rest the intra-node link's.
A tree all-reduce pays ``2 ((ranks per node - 1) intra + log2(nodes) inter)``, ranks per node
those of the fullest node.

Not modelled (each a refinement NCCL applies on top; named so a reader knows the gap): the
LL/LL128 protocols for small messages, the 0.9 and per-architecture caps on tree bandwidth,
the tree correction factors for medium sizes, the 1.9x ring latency "plateau" across nodes,
NVLS/CollNet (in-network reduction).

Groups spanning nodes: NCCL runs one ring (or tree) per channel and prices the collective at
``busBw = nChannels * bw`` (``tuning.cc``, ``ncclTopoTuneModel``), ``bw`` a channel's link
bandwidth, the network's (``bwInter``) beyond two nodes. Its topology search gives each
channel its own NIC where the node has one per GPU ("rails"): a group with k ranks in each
node leaves the node through k NICs at once. So a group spanning nodes moves at
``min(intra, k x inter)`` per rank, k the fewest of the group's ranks in any one node (12 ranks at
8 a node: 4; every channel's ring passes through every node), ``inter`` the network's bandwidth per GPU
(``plan.inter_node_gbps``) and ``intra`` the NVLink every channel of a node shares: the flat
group of 8 GPUs a node, 8 NICs; HSDP's replicate group (one rank a node), one. Eight GPUs
sharing one NIC have an eighth of it each: state ``inter`` so. HSDP's two levels (shard inside
a node, replicate across) are priced apart by :func:`hsdp_gradient_time`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from sharded_exp.errors import ConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ALGORITHMS = ("ring", "tree")

RING_BASE_LATENCY_S = 8.4e-6
"""NCCL ``tuning.cc`` ``baseLat[Ring][Simple]`` (commit 01afd20)."""
TREE_BASE_LATENCY_S = 0.0
"""NCCL ``tuning.cc`` ``baseLat[Tree][Simple]``: the tree's Simple latency is all in its hops."""


@dataclass(frozen=True)
class Link:
    """What pricing needs of a link: one direction's bandwidth per rank and per-step latencies.
    :class:`sharded_exp.speed.profiles.LinkProfile` has these attributes too (duck-typed)."""

    name: str
    bandwidth_Bps: float
    ring_step_latency_s: float = 0.0
    tree_step_latency_s: float = 0.0
    reduce_scatter_as_all_reduce: bool = False
    """gloo's rule: a reduce-scatter runs as an all-reduce of its whole input."""
    pair_call_s: Mapping[str, float] = field(default_factory=dict)
    """Per kind, one small call's seconds between two ranks, measured (see the profile's field)."""
    solo_call_s: Mapping[str, float] = field(default_factory=dict)
    """Per kind, one call's seconds in a group of one rank (see the profile's field)."""


@dataclass(frozen=True)
class Topology:
    """Where ranks sit: ``gpus_per_node`` per node, ``intra`` between GPUs of a node,
    ``inter`` between nodes (None: one node). Rank r is on node r // gpus_per_node."""

    gpus_per_node: int
    intra: Link
    inter: Link | None = None

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be at least 1, not {self.gpus_per_node}")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' algbw -> busbw factor for ``kind`` on ``n`` ranks (see the module docstring)."""
    _check(kind, n)
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def ring_steps(kind: str, n: int) -> int:
    """NCCL's ``nsteps`` for a ring (``tuning.cc``); with ``n`` = nodes, its ``nInterSteps``."""
    _check(kind, n)
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, n)


def collective_time(
    kind: str,
    nbytes: float,
    ranks: int,
    link: Link,
    algorithm: str = "ring",
) -> float:
    """Seconds for one collective among ``ranks`` ranks all on one ``link`` class (one node).

    ``nbytes`` is S as nccl-tests defines it (the whole array: for all-gather the gathered
    output, for reduce-scatter the full input). One rank moves nothing: it costs the call, as
    the link's ``solo_call_s`` states it (0 where it states none). On a link whose
    backend runs a reduce-scatter as an all-reduce (gloo: ``reduce_scatter_as_all_reduce``)
    it is priced as that all-reduce.
    """
    return group_time(kind, nbytes, ranks, Topology(max(ranks, 1), link), algorithm=algorithm)


def group_time(
    kind: str,
    nbytes: float,
    ranks: int,
    topology: Topology,
    stride: int = 1,
    algorithm: str = "ring",
) -> float:
    """Seconds for one collective among ``ranks`` ranks ``stride`` apart (ranks 0, stride,
    2 stride, ...) placed on ``topology``: the nodes they span set the bandwidth (once they span
    two, the slower of intra and the network of the fewest of the group's ranks in a node, one NIC
    each: see the module docstring) and which steps pay the network's latency.

    Warning: ``inter`` is a GPU's own network bandwidth (a NIC per GPU). Eight GPUs sharing one
    NIC have an eighth of it each: state it so.
    """
    _check(kind, ranks)
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm must be one of {ALGORITHMS}, not {algorithm!r}")
    if algorithm == "tree" and kind != "all_reduce":
        raise ConfigError(f"NCCL runs {kind} as a ring only (tree is for all_reduce); ask for algorithm='ring'")
    if nbytes < 0:
        raise ConfigError(f"a collective's size must be >= 0 bytes, not {nbytes}")
    if ranks == 1:  # nothing moves: the call alone, where the link states what it costs
        return getattr(topology.intra, "solo_call_s", {}).get(kind, 0.0) if nbytes else 0.0
    if kind == "reduce_scatter" and getattr(topology.intra, "reduce_scatter_as_all_reduce", False):
        kind = "all_reduce"  # gloo's reduce-scatter: an all-reduce of the whole input, then a copy
    if nbytes == 0:
        return 0.0
    in_node = Counter((r * stride) // topology.gpus_per_node for r in range(ranks))  # node -> the group's ranks there
    nodes = len(in_node)
    if nodes > 1 and topology.inter is None:
        raise ConfigError(
            f"{ranks} ranks {stride} apart span {nodes} nodes of {topology.gpus_per_node} GPUs, "
            "but the topology has no inter-node link"
        )
    intra, inter = topology.intra, topology.inter
    # Every channel's ring crosses into and out of every node, each through a NIC of its own: the
    # node with the fewest of the group's ranks (NICs) sets the bandwidth across nodes (12 ranks at
    # 8 a node: the second node's 4)
    nics = min(in_node.values())
    bandwidth = intra.bandwidth_Bps if nodes == 1 else min(intra.bandwidth_Bps, nics * inter.bandwidth_Bps)
    if algorithm == "ring":
        steps, inter_steps = ring_steps(kind, ranks), (ring_steps(kind, nodes) if nodes > 1 else 0)
        pair = getattr(intra, "pair_call_s", {}).get(kind) if nodes == 1 else None
        if pair is not None:  # measured: this kind's small call between two ranks, its steps scaled
            latency = pair * steps / ring_steps(kind, 2)
        else:
            latency = RING_BASE_LATENCY_S + (steps - inter_steps) * intra.ring_step_latency_s
        if inter_steps:
            latency += inter_steps * inter.ring_step_latency_s
        return latency + nbytes * bus_factor(kind, ranks) / bandwidth
    latency = TREE_BASE_LATENCY_S + 2 * (max(in_node.values()) - 1) * intra.tree_step_latency_s  # the fullest node
    if nodes > 1:
        latency += 2 * math.log2(nodes) * inter.tree_step_latency_s
    return latency + 2 * nbytes / bandwidth


def hsdp_gradient_time(nbytes: float, shard: int, replicate: int, topology: Topology) -> tuple[float, float]:
    """HSDP's gradient sync priced per level: (reduce-scatter among the ``shard`` ranks of a
    replica, all-reduce of each rank's 1/shard among the ``replicate`` replicas).

    Ranks are laid out shard-major (torch's ``init_device_mesh((replicate, shard))``): a shard
    group is ``shard`` consecutive ranks, inside one node when ``shard <= gpus_per_node``; a
    replicate group is ranks ``shard`` apart, across nodes. ``nbytes``: the full gradient (S of
    the reduce-scatter)."""
    # a shard group of one: FSDP2 copies the gradient instead (torch 2.13's foreach_reduce)
    reduce_scatter = 0.0 if shard == 1 else group_time("reduce_scatter", nbytes, shard, topology)
    all_reduce = group_time("all_reduce", nbytes / shard, replicate, topology, stride=shard)
    return reduce_scatter, all_reduce


def pricer(ranks: int, topology: Topology, algorithm: str = "ring") -> Callable[[str, float], float]:
    """``price(kind, nbytes) -> seconds`` for the flat group of all ``ranks``: what the
    strategies' schedules (:mod:`sharded_exp.speed.schedule`) take. All-reduce uses
    ``algorithm``; the other collectives are rings."""

    def price(kind: str, nbytes: float) -> float:
        algo = algorithm if kind == "all_reduce" else "ring"
        return group_time(kind, nbytes, ranks, topology, algorithm=algo)

    return price


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ConfigError(f"collective kind must be one of {KINDS}, not {kind!r}")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"a collective needs at least 1 rank, not {n!r}")
