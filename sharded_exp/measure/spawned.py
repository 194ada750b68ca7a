"""Processes spawned to measure something, waited for with an end: never forever.

The measuring processes of the ``this`` profile (:mod:`sharded_exp.measure.machine`), and the
ranks that tests and benchmarks start by hand, make a gloo process group and tear it down.
Tearing gloo down can hang: its destructor waits for a thread that waits for the GIL the
destructor holds. ``mp.start_processes(join=True)`` would then wait forever although the
figures are in. :func:`run_spawned` waits until they are, gives the processes a short grace
to exit, and kills those still alive; processes that never give their figures are killed at
a limit, with an error naming what was measured.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch.multiprocessing as mp

log = logging.getLogger(__name__)

LIMIT_S = 600.0
"""Seconds the processes of one measurement get (it takes seconds: starting them and importing
torch is most of it) before they are killed and the measurement fails."""
EXIT_GRACE_S = 10.0
"""Seconds the processes get to exit once the figures are in; then they are killed."""


def run_spawned(
    fn,
    args: tuple,
    nprocs: int,
    done: Callable[[], bool],
    what: str,
    limit_s: float | None = None,
    start_method: str = "spawn",
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes until ``done()`` says their figures
    are in and they have exited, or :data:`EXIT_GRACE_S` after that (the rest killed, the
    figures kept). A process that fails raises here (torch's ProcessRaisedException or
    ProcessExitedException), its peers killed. Past ``limit_s`` (:data:`LIMIT_S`) every process
    is killed and a TimeoutError names ``what``. ``done`` is called in this process, between
    waits: it may read what the processes sent."""
    limit_s = LIMIT_S if limit_s is None else limit_s
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method=start_method, join=False)
    deadline, done_at = time.monotonic() + limit_s, None
    try:
        while not context.join(timeout=0.2):
            now = time.monotonic()
            if done_at is None and done():
                done_at = now
            if done_at is not None and now - done_at > EXIT_GRACE_S:
                log.warning("%s: the figures came, but the process(es) had not exited %g s later "
                            "(stuck tearing down); killed", what, EXIT_GRACE_S)  # fmt: skip
                return
            if now > deadline:
                raise TimeoutError(f"{what}: the process(es) gave no figures within {limit_s:g} s; killed")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
            proc.join()
    done()  # what was sent just before the processes exited
