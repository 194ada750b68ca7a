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
