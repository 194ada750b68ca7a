"""Liveness on the rank side: stopping together on a signal, and naming a rank that hangs.

Both cost (next to) nothing per step; ``benchmarks/harness/overhead.py`` measures the loop.

Stopping: SIGTERM (cluster preemption, ``scancel``, torchrun passing one on) or SIGINT
(Ctrl-C) only sets a flag. Ranks must agree on the step at which they stop, or one would
leave a collective its peers are waiting in: at agreed steps, about once a second, the
flag is all-reduced over a separate gloo group together with the number of steps until
the next check (from the measured step time), asynchronously. An all-reduce every step
cost 6% of a 12 ms step on 2 CPU cores; once a second, never waited on, it is lost in
the noise, and a stop still comes within about two seconds plus one step.

Hangs: a rank whose collective times out writes the step it was in to the rendezvous
store and gives its peers a few seconds to do the same. The ranks that never write are
the ones that did not arrive (hung, stuck, or dead) and are named in the error
(:func:`describe_timeout`); if every rank timed out, they are all waiting in
collectives that do not match.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from sharded_exp.train import kept_works

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that ask a job to stop: SIGHUP is a closed terminal, handled as SIGTERM."""
CHECK_PERIOD_S = 1.0
"""Seconds between stop checks (the all-reduce of the stop flag)."""
REPORT_WINDOW_S = 3.0
"""Seconds a timed-out rank waits for its peers to report their own timeouts."""

_requested: list[int] = []  # signals received by this rank, first one first
current_step = -1
"""The step this rank is in (set by the trainer; read when a collective times out)."""
steps_done: int | None = None
"""Steps this rank has completed (set by the trainer after each; read when the rank fails: a
failure between steps or after the loop has done them all)."""


def _on_signal(signum, frame) -> None:
    # Only a flag: the step in progress finishes, collectives stay matched.
    _requested.append(signum)


def catch_stop_signals() -> None:
    """First thing a rank does: from now on SIGTERM/SIGINT/SIGHUP only request a stop."""
    _requested.clear()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def requested_signal() -> int | None:
    return _requested[0] if _requested else None


class StopAgreement:
    """Collective stop decision; call :meth:`should_stop` at the start of every step.

    At agreed check steps each rank contributes (stop requested?, steps until the next
    check) to an asynchronous all-reduce whose result is read at the following check:
    no rank ever waits for another here. A stop requested anywhere is seen by every rank
    at the same check, one or two periods later.
    """

    def __init__(self):
        self._group = dist.new_group(backend="gloo")  # CPU flag: works beside NCCL too
        self._next_check = -1
        self._last: tuple[int, float] | None = None
        self._buf = torch.zeros(2, dtype=torch.float64)
        self._work = None
        self._agreed: int | None = None

    @property
    def signum(self) -> int | None:
        """The signal that stopped the job: this rank's, else the one a peer received."""
        return requested_signal() or self._agreed

    def should_stop(self, step: int) -> bool:
        if step < self._next_check:
            return False
        interval = 1
        if self._work is not None:
            self._work.wait()  # issued a period ago by every rank: long complete
            if self._buf[0].item() > 0:
                self._agreed = int(self._buf[0].item())  # the signal number some rank received
                return True
            interval = int(-self._buf[1].item())
        # Propose the steps until the check after next, so checks come CHECK_PERIOD_S apart.
        now = time.monotonic()
        proposal = 1
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            proposal = max(1, min(10_000, int(CHECK_PERIOD_S / max(per_step, 1e-6))))
        self._last = (step, now)
        # MAX of (signal number or 0, -proposal): anyone's stop request, and the shortest interval.
        self._buf = torch.tensor([float(requested_signal() or 0), -float(proposal)], dtype=torch.float64)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._next_check = step + interval
        return False

    def finish(self) -> None:
        """At the end of the loop on every rank: complete the all-reduce in flight."""
        if self._work is not None:
            kept_works.keep(self._work).wait()  # gloo's thread may not let go of it last (kept_works)
            self._work = None


def is_timeout(exc: BaseException) -> bool:
    """A collective that timed out: gloo's error, or NCCL's once its watchdog aborted the
    communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set by launch.rank)."""
    text = str(exc).lower()
    return any(s in text for s in ("timed out", "timeout", "communicator was aborted", "watchdog"))


def raise_if_aborted(device: torch.device) -> None:
    """After a step on CUDA: raise if NCCL's watchdog aborted the communicator meanwhile.
    In our error mode (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) the abort lets the step's
    ``synchronize()`` return as if all went well, and the error surfaced only at the next
    step's first collective: the report named the wrong step. Gloo raises in the step."""
    if device.type != "cuda":
        return
    backend = dist.group.WORLD._get_backend(device)
    error = collective_error(backend)
    if error is not None:
        raise RuntimeError(
            f"NCCL reported {error} in step {current_step}: the communicator was aborted by its watchdog "
            "(a collective timed out)"
        )


def collective_error(backend) -> str | None:
    """The error a process group's backend reports (NCCL's ``get_error``), or None."""
    get_error = getattr(backend, "get_error", None)
    if get_error is None:  # gloo: errors are raised by the collective itself
        return None
    error = get_error()
    name = getattr(error, "name", str(error))
    return None if name == "SUCCESS" else name


def describe_timeout(exc: BaseException, timeout_s: float) -> str:
    """Report this rank's timeout, wait for the peers' reports, name the missing ranks."""
    store = distributed_c10d._get_default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store.set(f"sharded_exp/timed_out/{rank}", str(current_step))
    keys = [f"sharded_exp/timed_out/{r}" for r in range(world_size)]
    end = time.monotonic() + REPORT_WINDOW_S
    while time.monotonic() < end and not store.check(keys):
        time.sleep(0.1)
    steps = {r: int(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    missing = [r for r in range(world_size) if r not in steps]
    where = ", ".join(f"rank {r}: step {s}" for r, s in steps.items())
    if missing:
        names = ", ".join(str(r) for r in missing)
        return (
            f"collective timed out after {timeout_s:g} s (trainer.timeout_s) in step {current_step}: "
            f"rank {names} did not arrive (ranks that were waiting: {where})"
        )
    return (
        f"collective timed out after {timeout_s:g} s (trainer.timeout_s): every rank was waiting ({where}), "
        f"in collectives that do not match; {str(exc).splitlines()[0]}"
    )
