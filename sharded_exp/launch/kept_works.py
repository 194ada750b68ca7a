"""Collectives whose works this process lets go of, never gloo's worker thread.

Why: a gloo collective's work holds the tensors it was given. When gloo's worker thread
drops the last C++ reference to a tensor that Python has seen, torch 2.13 lets go of the
tensor's Python object there, and that needs the GIL (``TensorImpl::decref_pyobject``).
The worker drops its reference just after the work completes. If the main thread, at that
moment, destroys the process group while holding the GIL (DDP's ``Reducer`` holds the
group's last reference and is freed when the model is), ``~ProcessGroupGloo`` joins the
worker, which waits for the GIL: the process never exits. Seen under the probe: a user's
script printed its result, then hung (gdb: ``pt_gloo_runloop`` in ``take_gil`` under
``~AsyncAllgatherWork``, the main thread in ``~ProcessGroupGloo``'s join under
``~Reducer``), about once in ten runs on a loaded machine. ``dist.all_gather_object``
drops its works as it returns, so the probe's last collective, a gather just before the
user's teardown, was the one found in the worker's hands.

A work kept here outlives the worker's reference: the worker's drop is never the last,
so it needs no GIL, and the work is freed later by this process's own thread (with the
GIL) when newer works push it out or at exit.
"""

from __future__ import annotations

import collections
import pickle
from typing import Any

import torch
import torch.distributed as dist

KEPT_WORKS = 64
"""How many of the latest works are kept: one pushed out is long complete and long let go
of by gloo's worker (a worker takes its next work only after dropping its last)."""

_kept: collections.deque = collections.deque(maxlen=KEPT_WORKS)


def keep(work):
    """Hold ``work`` (and the tensors it holds) in this process; returns it."""
    if work is not None:
        _kept.append(work)
    return work


def kept() -> list:
    """The works held now, oldest first (for tests and diagnostics)."""
    return list(_kept)


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` in rank order, as ``dist.all_gather_object`` gives it.

    On gloo the two all-gathers (sizes, then the padded pickles) are kept (:func:`keep`).
    Other backends (NCCL) take torch's own function: their works are not dropped by a
    thread that the group's destructor joins."""
    world = dist.get_world_size(group)
    if "gloo" not in str(dist.get_backend(group)):
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    keep(dist.all_gather(sizes, size, group=group, async_op=True)).wait()
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    outputs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    keep(dist.all_gather(outputs, padded, group=group, async_op=True)).wait()
    return [pickle.loads(out[: int(n)].numpy().tobytes()) for out, n in zip(outputs, sizes)]
