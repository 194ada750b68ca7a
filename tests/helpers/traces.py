"""A made-up allocation trace of a stack of identical blocks, at any depth (plan/deepen.py's tests)."""

from __future__ import annotations

import itertools

MIB = 2**20


def model_trace(blocks: int) -> list:
    """The allocations of one step of a ``blocks``-block model (ids counted from 0):

    - each block's weight (4 MiB), kept;
    - forward, per block: a 3 MiB temporary, the 2 MiB activation kept, the temporary freed;
    - the activations freed in the order they were made;
    - the optimizer: a 1 MiB temporary per block, freed in the order made;
    - a bucket of 1 MiB per block and 256 KiB (grows with the depth), freed; the step's end.
    """
    ids = itertools.count()
    events = [("malloc", next(ids), 4 * MIB, "default") for _ in range(blocks)]
    acts = []
    for _ in range(blocks):
        tmp, act = next(ids), next(ids)
        events += [("malloc", tmp, 3 * MIB, "default"), ("malloc", act, 2 * MIB, "default"), ("free", tmp, 0, None)]
        acts.append(act)
    events += [("free", act, 0, None) for act in acts]
    temporaries = [next(ids) for _ in range(blocks)]
    events += [("malloc", t, MIB, "default") for t in temporaries] + [("free", t, 0, None) for t in temporaries]
    bucket = next(ids)
    events += [("malloc", bucket, blocks * MIB + MIB // 4, "default"), ("free", bucket, 0, None)]
    return events + [("sync", None, 0, None)]


def prefetch_trace(blocks: int) -> list:
    """One step of a ``blocks``-block model whose units are gathered ahead, as FSDP2 prefetches
    (ids counted from 0):

    - forward: unit 0 gathered (8 MiB on the ``gather`` stream); per block, the next unit
      gathered first (the prefetch), then a 2 MiB activation kept and a 1 MiB temporary made
      and freed, then the block's own gathered unit freed: at most two gathered units live;
    - backward, the blocks in reverse the same way: the unit before gathered first, the
      block's activation freed and a 1 MiB temporary made and freed, its gathered unit freed;
    - the step's end.

    Each gathered unit is freed inside the next block's run: a block's events straddle its end.
    """
    ids = itertools.count()
    events: list = []

    def gather() -> int:
        ident = next(ids)
        events.append(("malloc", ident, 8 * MIB, "gather"))
        return ident

    def temporary() -> None:
        ident = next(ids)
        events.extend([("malloc", ident, MIB, "default"), ("free", ident, 0, None)])

    acts = []
    unit = gather()
    for j in range(blocks):
        ahead = gather() if j + 1 < blocks else None
        act = next(ids)
        events.append(("malloc", act, 2 * MIB, "default"))
        acts.append(act)
        temporary()
        events.append(("free", unit, 0, None))
        unit = ahead
    unit = gather()
    for j in reversed(range(blocks)):
        ahead = gather() if j > 0 else None
        events.append(("free", acts[j], 0, None))
        temporary()
        events.append(("free", unit, 0, None))
        unit = ahead
    return events + [("sync", None, 0, None)]


def paired_trace(blocks: int) -> list:
    """Each block makes two 1 MiB tensors, then the step frees them block by block, each block's
    second first: the allocator sees the same event twice per block, so a block's events repeat
    within it, and only two events, not one, are one block's."""
    ids = itertools.count()
    pairs = [(next(ids), next(ids)) for _ in range(blocks)]
    events = [("malloc", ident, MIB, "default") for pair in pairs for ident in pair]
    events += [("free", ident, 0, None) for pair in pairs for ident in reversed(pair)]
    return events + [("sync", None, 0, None)]


def renumbered(events: list) -> list:
    """``events`` with each allocation's id its rank in the order the allocations are made."""
    rank: dict = {}
    out = []
    for op, ident, size, stream in events:
        if op == "malloc":
            rank[ident] = len(rank)
        out.append((op, rank.get(ident, ident), size, stream))
    return out


def dealt_trace(blocks: int) -> list:
    """``model_trace`` with the faked rank's step temporary of one dealt tensor, whose size
    moves with the depth as whole tensors dealt out to ranks do (ZeRO-1, OSS: the largest rank
    steps another tensor at each depth): 256 KiB at an odd depth, 192 KiB at an even one, made
    and freed before the bucket. Nothing else differs from ``model_trace``."""
    events = model_trace(blocks)
    size = 256 * 1024 if blocks % 2 else 192 * 1024
    cut = len(events) - 3  # before the bucket's malloc, free and the step's end
    return events[:cut] + [("malloc", "dealt", size, "default"), ("free", "dealt", 0, None)] + events[cut:]


def alternating_trace(blocks: int) -> list:
    """``model_trace`` whose faked rank, at an even depth, also holds a 512-byte state on a
    stream of its own, as the largest rank of two alternates with the depth and only one holds
    a small tensor's state: the odd depth's trace has an allocation fewer, so it is no block
    step from the even one below it."""
    return ([("malloc", "odd", 512, "side")] if blocks % 2 == 0 else []) + model_trace(blocks)


def piled_trace(blocks: int) -> list:
    """One step of a ``blocks``-block model whose forward keeps each block's 12 MiB unit until
    the next block's is made (ids counted from 0), then allocates and frees a 300 MiB tensor
    (the step's peak, after every unit is freed) and ends. Each unit is over 10 MiB, so it gets a
    segment of its own: two segments hold every unit at any depth, 324 MiB reserved."""
    ids = itertools.count()
    events: list = []
    before = None
    for _ in range(blocks):
        unit = next(ids)
        events.append(("malloc", unit, 12 * MIB, "default"))
        if before is not None:
            events.append(("free", before, 0, None))
        before = unit
    events += [("free", before, 0, None), ("malloc", "peak", 300 * MIB, "default"), ("free", "peak", 0, None)]
    return events + [("sync", None, 0, None)]


def embedded_trace(blocks: int) -> list:
    """One step of a ``blocks``-block model after an embedding, as fsdp_grad_op runs it (ids
    counted from 0), whose first block refers to what the embedding made where each later
    block refers to what the block before it made:

    - the embedding: its unit gathered (6 MiB), two 1 MiB temporaries made, its 2 MiB output
      made, the temporaries freed;
    - per block: its unit gathered (4 MiB), a 1 MiB activation kept, the unit before freed (the
      embedding's, of another size, for the first block), a 1 MiB temporary made, the 2 MiB
      output kept (the next block's input), the temporary freed;
    - the last unit freed, the last output freed (the head's work);
    - backward, the blocks in reverse: each frees its activation, then its input (the output of
      the block before it; the embedding's output for the first block);
    - the step's end."""
    ids = itertools.count()
    events: list = []

    def made(size: int) -> int:
        ident = next(ids)
        events.append(("malloc", ident, size, "default"))
        return ident

    unit, first, second = made(6 * MIB), made(MIB), made(MIB)
    inputs, acts = [made(2 * MIB)], []
    events += [("free", first, 0, None), ("free", second, 0, None)]
    for _ in range(blocks):
        mine = made(4 * MIB)
        acts.append(made(MIB))
        events.append(("free", unit, 0, None))
        unit, temporary = mine, made(MIB)
        inputs.append(made(2 * MIB))
        events.append(("free", temporary, 0, None))
    events += [("free", unit, 0, None), ("free", inputs[-1], 0, None)]
    for j in reversed(range(blocks)):
        events += [("free", acts[j], 0, None), ("free", inputs[j], 0, None)]
    return events + [("sync", None, 0, None)]


def rotated_trace(blocks: int) -> list:
    """``model_trace`` whose run of frees after the forward (the last block's 3 MiB temporary,
    then the 2 MiB activations) comes in another rotation at each depth (starting from the run's
    event at index ``1 + blocks % 2``, counted from 0), as autograd's graph, released after the loss's backward, frees tensors in
    an order that follows Python's: no block's events repeat the block before's in the order
    faked, only with each run of frees in one order."""
    events = model_trace(blocks)
    first = next(q for q, e in enumerate(events) if e[0] == "free" and events[q + 1][0] == "free")
    run = events[first : first + blocks + 1]
    k = 1 + blocks % 2
    return events[:first] + run[k:] + run[:k] + events[first + blocks + 1 :]
