"""Which model states each rank holds under a strategy: its memory model.

A strategy's memory model (``Strategy.memory``) is a class of class methods over shapes
and element counts: nothing is built, so the prediction (:mod:`sharded_exp.predict`), the
planner (:mod:`sharded_exp.plan`) and the probe read it for a 7B model in milliseconds.
This base holds every state whole on every rank, with no buckets and nothing gathered;
each strategy's module subclasses it with what differs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def greedy_partition(group_numels: Sequence[Sequence[int]], world_size: int, largest_first: bool = False) -> list[int]:
    """Owner rank of every parameter (flattened in group order), as fairscale OSS assigns it:
    each to the rank with the least so far, the lowest rank among equals (a heap: a plan at
    10,000 ranks takes milliseconds). ``largest_first``: each group's parameters in order of
    size, largest first (torch's ZeroRedundancyOptimizer)."""
    heap = [(0, rank) for rank in range(world_size)]
    owners = []
    for group in group_numels:
        order = sorted(range(len(group)), key=lambda i: -group[i]) if largest_first else range(len(group))
        group_owners = [0] * len(group)
        for i in order:
            size, rank = heapq.heappop(heap)
            group_owners[i] = rank
            heapq.heappush(heap, (size + group[i], rank))
        owners += group_owners
    return owners


class MemoryModel:
    """Every state whole on every rank; no buckets, nothing gathered, no set-up moment."""

    depth_line_from = 1
    """The shallowest depth (blocks) from which each part of a fake step's peak grows on a
    line as the model deepens under this strategy: the planner fakes a deep model at this
    depth and the two above it and draws the rest (sharded_exp.plan.depth)."""
    depth_lines_per_world_size = False
    """True when whether the peak lies on a line in depth depends on the world size (the
    planner then checks the line at every world size, not at the first alone)."""
    tensors_by_world_size = True
    """False where a rank holds the same tensors at every world size, made and freed in the
    same order (DDP: the whole model, its gradients and optimizer state, and buckets of
    ``bucket_cap_mb``, whatever the world size): its fake step asks the CUDA allocator the
    same at every world size, and the planner draws the allocator's trace at the first
    world size only (sharded_exp.plan.depth)."""
    peak_grows_with_ranks: str = ""
    """Why this strategy's peak per rank can grow as ranks are added, in one clause the sweep
    report quotes where a sweep shows it (sharded_exp.report.text); empty where the model holds
    nothing that grows with the world size. A reader expects sharding to shrink the peak, so a
    peak that grows needs its reason said."""
    side_streams: tuple[str, ...] = ()
    """The CUDA streams besides the default one on which the strategy allocates, in order of
    their first allocation in a step (entered through the device's stream context): the
    caching allocator keeps a pool per stream (sharded_exp.predict.alloc_trace). NCCL's own
    stream is every strategy's and is not listed."""

    @staticmethod
    def partition(group_numels, world_size: int) -> list[int]:
        """Owner rank of each parameter's optimizer state (fairscale OSS's greedy rule)."""
        return greedy_partition(group_numels, world_size)

    @staticmethod
    def owned(numels, owners, rank: int) -> list[int]:
        """The sizes of the tensors whose optimizer state ``rank`` owns (the ZeRO-1 rule)."""
        return [n for n, o in zip(numels, owners) if o == rank]

    @classmethod
    def transient_param_numel(cls, cfg, block_numels, root_numel: int, world_size: int) -> int:
        """Parameter elements gathered on top of the resident ones at the peak (none here).

        ``block_numels``: the model's units' sizes (``models.units``); ``root_numel``: everything else.
        """
        return 0

    @classmethod
    def bucket_numel(cls, cfg, numels, owners, rank: int, world_size: int) -> tuple[int, int]:
        """Elements of the communication buckets ``rank`` keeps for the whole run (allocated
        when the model is wrapped), and how many of those elements are also its gradients
        (gradients that are views into a bucket): ``(0, 0)`` without buckets.

        ``numels``: the trainable parameters' sizes; ``owners``: their optimizer-shard rank."""
        return 0, 0

    @classmethod
    def setup_transient_mib(cls, cfg, shapes, world_size: int) -> float:
        """MiB this strategy allocates for a moment while it sets up (beyond what it keeps):
        a deep model's peak is composed from shallow ones only where this moment cannot be
        the peak (sharded_exp.plan.depth). Nothing by default."""
        return 0.0

    @classmethod
    def optimizer_numels(cls, numels, owners, rank: int) -> list[int]:
        """The sizes of the tensors whose optimizer state ``rank`` keeps: all of them here."""
        return list(numels)

    @classmethod
    def resident_numel(cls, cfg, shapes, owners, rank: int, world_size: int) -> dict:
        """Elements of each model state that ``rank`` holds (for the memory model).

        ``shapes``: every parameter's shape; ``owners``: its optimizer-shard rank.
        Returns ``params`` and ``grads`` element counts and ``optimizer``, the sizes of the
        tensors whose optimizer state the rank keeps (:meth:`optimizer_numels`).
        """
        numels = [math.prod(s) for s in shapes]
        return {"params": sum(numels), "grads": sum(numels), "optimizer": cls.optimizer_numels(numels, owners, rank)}
