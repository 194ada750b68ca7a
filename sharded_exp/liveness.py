"""Liveness on the rank side: stopping together on a signal, and naming a rank that hangs.

Stopping: SIGTERM (cluster preemption, ``scancel``, torchrun passing one on) or SIGINT
(Ctrl-C) only sets a flag. Ranks must agree on the step at which they stop, or one would
leave a collective its peers are waiting in: the flag is all-reduced over a separate gloo
group, asynchronously, one all-reduce in flight per step. A request seen during step s
therefore stops every rank before step s+2, at the same step.

Hangs: before each step a rank records the step it enters in the rendezvous store. When a
collective times out, the ranks that waited read those records and name the rank(s)
that never entered the step their peers were stuck in (:func:`describe_timeout`).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_KEY = "sharded_exp/entered/{}"


_requested: list[int] = []  # signals received by this rank, first one first


def _on_signal(signum, frame) -> None:
    # Only a flag: the step in progress finishes, collectives stay matched.
    _requested.append(signum)


def catch_stop_signals() -> None:
    """First thing a rank does: from now on SIGTERM/SIGINT only request a stop."""
    _requested.clear()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def requested_signal() -> int | None:
    return _requested[0] if _requested else None


class StopAgreement:
    """Collective stop decision, checked once per step at the same point on every rank."""

    def __init__(self):
        self._group = dist.new_group(backend="gloo")  # CPU flag: works beside NCCL too
        self._flag = torch.zeros(1)
        self._work = None

    @property
    def signum(self) -> int | None:
        return requested_signal()

    def should_stop(self) -> bool:
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item() > 0)
        self._work = None
        if not stop:
            self._flag.fill_(float(requested_signal() is not None))
            self._work = dist.all_reduce(self._flag, group=self._group, async_op=True)
        return stop

    def close(self, wait: bool) -> None:
        """``wait``: finish the last flag all-reduce (every rank issued it, so it
        completes -- unless a peer failed, then pass False)."""
        if wait and self._work is not None:
            self._work.wait()
        self._work = None


def mark_entered(step: int) -> None:
    """Record in the rendezvous store that this rank entered ``step``."""
    distributed_c10d._get_default_store().set(_KEY.format(dist.get_rank()), str(step))


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def describe_timeout(exc: BaseException, timeout_s: float) -> str:
    """Which rank(s) did not arrive: those that entered an earlier step than the others."""
    store = distributed_c10d._get_default_store()
    entered = {}
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank)
        entered[rank] = int(store.get(key)) if store.check([key]) else -1
    newest = max(entered.values())
    late = [r for r, s in entered.items() if s < newest]
    where = ", ".join(f"rank {r}: {'none' if s < 0 else s}" for r, s in entered.items())
    if late:
        names = ", ".join(str(r) for r in late)
        return (
            f"collective timed out after {timeout_s:g} s (trainer.timeout_s) in step {newest}: "
            f"rank {names} did not arrive (last step entered per rank: {where})"
        )
    return (
        f"collective timed out after {timeout_s:g} s (trainer.timeout_s): every rank entered step {newest} "
        f"and none finished it, e.g. mismatched collectives ({where}); {str(exc).splitlines()[0]}"
    )
