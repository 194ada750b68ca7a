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
``~Reducer``), in 3 of 25 DDP runs of the plain example on a loaded machine. ``dist.all_gather_object``
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


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order, as ``dist.all_gather_object`` on the default group
    gives it.

    On gloo (or a CPU-gloo, CUDA-NCCL group) the two all-gathers (sizes, then the padded
    pickles) go over gloo with CPU tensors, whatever the default device, and are kept
    (:func:`keep`). A NCCL-only group takes torch's own function, as before: its works were
    never seen to hang this way, and no GPU here can check them."""
    world = dist.get_world_size()
    if "gloo" not in str(dist.get_backend()):
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj)
        return gathered
    cpu = torch.device("cpu")
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=cpu)
    sizes = [torch.zeros(1, dtype=torch.int64, device=cpu) for _ in range(world)]
    keep(dist.all_gather(sizes, size, async_op=True)).wait()
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=cpu)
    padded[: payload.numel()] = payload
    outputs = [torch.empty(longest, dtype=torch.uint8, device=cpu) for _ in range(world)]
    keep(dist.all_gather(outputs, padded, async_op=True)).wait()
    return [pickle.loads(out[: int(n)].numpy().tobytes()) for out, n in zip(outputs, sizes)]
