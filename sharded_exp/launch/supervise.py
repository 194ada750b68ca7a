"""Supervising the ranks: start them, watch them, and name the first one that failed.

Spawned ranks rendezvous through a TCPStore the parent holds on a port the OS picks (two
jobs on one machine never collide). The parent reads each rank's "finished" message as it
comes, passes SIGTERM/SIGINT on to the ranks and kills those that outlive the grace period,
so no process outlives the job. Under torchrun or srun the parent is itself one rank.

Warning:
    A rank that dies without a record (``os._exit``, a signal, the kernel's OOM killer) is
    the first failure even though its peers fail after it, losing their connection: the
    peers' records would otherwise be blamed. :class:`RankDied` names it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

from sharded_exp.job.result import PartialResult
from sharded_exp.job.spec import JobSpec
from sharded_exp.launch import forkserver
from sharded_exp.launch.layout import Layout, rendezvous_env
from sharded_exp.launch.rank import release_ranks, run_rank, spawned_entry
from sharded_exp.train import liveness

log = logging.getLogger(__name__)


def run_ranks(job: JobSpec, layout: Layout | None, release: Release | None = None) -> PartialResult | None:
    """Run the job's ranks: spawn them, or be the one rank an external launcher started.
    Rank 0's payload carries status "ok" or "stopped"; other torchrun ranks get None.
    ``release``: what spawned ranks wait for before their first step (:func:`spawn`)."""
    if layout is None:
        return spawn(job, job.world_size, release)
    for key, value in rendezvous_env(layout).items():
        os.environ.setdefault(key, value)
    entry = run_rank
    if layout.launcher == "torchrun":
        # torchrun's own error file: its summary then names this rank's exception as the root cause.
        entry = record(run_rank)
    return entry(job, layout.rank, layout.world_size, layout.local_rank, layout.local_world_size)


def spawn(job: JobSpec, world_size: int, release: Release | None = None) -> PartialResult:
    """Run ``world_size`` ranks as child processes; return rank 0's payload or raise.

    ``release`` (where ``job.wait_for_release``): waited for once the ranks are started; the
    ranks wait, once built, for what it gives (the peak prediction) before their first step.
    Where it raises (the job refused), the ranks are killed and :class:`Unreleased` raised."""
    # forkserver: children fork from a clean server process that imported torch once, so a
    # sweep pays the import once; plain fork would inherit the parent's OpenMP pool (and
    # deadlock), and CUDA cannot be forked after initialisation.
    ctx = forkserver.context()  # usually running already: started by __main__ before its imports
    results = ctx.SimpleQueue()
    timeout = datetime.timedelta(seconds=job.config["trainer"]["timeout_s"])
    # The parent holds the rendezvous store on a port the OS picks: no collisions.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store_addr = {"host": "127.0.0.1", "port": store.port}
    stop = ParentStop(job.config["trainer"]["stop_grace_s"])
    finished: dict[int, Any] = {}  # rank -> its payload (None but on rank 0)
    context = None
    try:
        with stop.handling_signals():  # before the ranks exist: no signal leaves orphans
            context = mp.start_processes(
                spawned_entry,
                args=(world_size, job, store_addr, results),
                nprocs=world_size,
                start_method="forkserver",
                join=False,
            )
            # Only the ranks write: a rank that dies in the middle of a message then leaves the
            # parent's read at the end of the pipe (EOFError, :func:`_drain`) once its peers are
            # gone, where the parent's own copy of the writing end would keep it waiting forever.
            results._writer.close()
            stop.watch(context.processes)
            if release is not None:
                _release(context.processes, store, release, stop)
            _watch(context, stop, results, finished)
    except Exception as exc:
        if stop.signum is not None:  # ranks that died of the signal, or were killed
            raise Stopped(stop.signum, killed=stop.killed) from None
        if isinstance(exc, (RankDied, Unreleased)):
            raise
        first = _first_failure(exc, context, results, finished, job.output_dir)
        if first is None:
            raise
        raise first from None
    early = _exited_unfinished(context.processes, finished, results)
    if early is not None:  # every rank exited with code 0, and this one never finished
        raise RankDied(early, 0)
    payload = finished[0]
    if payload.status == "stopped" and stop.signum is not None:
        payload = payload.updated(signal=stop.signum)  # the job's signal (ranks may also see Ctrl-C's SIGINT)
    return payload


class Unreleased(Exception):
    """The ranks were not released, and were killed before their first step: ``cause`` is why
    (what the release raised: the job refused, or its check gone), for the caller to raise as
    if no rank had started."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Release:
    """What spawned ranks wait for before their first step (:func:`spawn`)."""

    wait: Callable[[], Any]
    """Waits for it and returns it (the peak prediction), or raises (the job refused)."""
    abandon: Callable[[], None]
    """Ends the wait at once (a stop signal came): :attr:`wait` then raises. Safe in a signal handler."""


def _release(processes, store, release: Release, stop: ParentStop) -> None:
    """Release the started ranks with what ``release`` gives. Where it fails, or a signal came
    meanwhile (which abandons the wait), kill them (they wait before their first step: nothing
    of theirs is lost) and raise :class:`Unreleased` or :class:`Stopped`."""
    stop.abandon = release.abandon
    try:
        word = release.wait()
    except BaseException as exc:
        _kill_all(processes)
        if stop.signum is not None:
            stop.killed = stop.killed or "before their first step"
            raise Stopped(stop.signum, killed=stop.killed) from None
        if isinstance(exc, Exception):
            raise Unreleased(exc) from exc
        raise
    finally:
        stop.abandon = None
    if stop.signum is not None:
        _kill_all(processes)
        stop.killed = stop.killed or "before their first step"
        raise Stopped(stop.signum, killed=stop.killed)
    release_ranks(store, word)


def _kill_all(processes) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join()


def _watch(context, stop: ParentStop, results, finished: dict[int, Any]) -> None:
    """Wait for the ranks to end, reading their messages as they come; raise at the first failure.

    When a rank fails, its peers get 2 s to exit by themselves, then SIGTERM, 2 s more, then
    SIGKILL (torch's default would wait 30 s). Every rank says it finished, rank 0 with its
    payload; messages are read as soon as they are sent: a payload larger than the pipe's
    buffer (a long history) blocks rank 0 in put() until read, and it would never exit.
    """
    all_finished_at = None
    while not context.join(timeout=0.5, grace_period=2.0):
        _drain(results, finished)
        early = _exited_unfinished(context.processes, finished, results)
        if early is not None:  # its peers wait for it in a collective: no need to wait on
            raise RankDied(early, 0)
        stop.enforce_deadline()
        if len(finished) == len(context.processes):
            all_finished_at = all_finished_at or time.monotonic()
            if time.monotonic() - all_finished_at > stop.grace_s:
                _kill_stuck_after_finishing(context.processes, stop.grace_s)
                return
    _drain(results, finished)


def _kill_stuck_after_finishing(processes, grace_s: float) -> None:
    """Every rank sent its payload, and some are still alive ``grace_s`` later: stuck tearing
    down (gloo's destructor can wait forever for a thread that waits for the GIL). Nothing of
    the run is lost: kill them, say so, and go on."""
    stuck = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
    log.warning(
        "rank(s) %s finished training but had not exited trainer.stop_grace_s=%g s later (stuck tearing down "
        "the process group); killed, the results are complete",
        ", ".join(map(str, stuck)),
        grace_s,
    )
    for proc in processes:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _first_failure(exc: Exception, context, results, finished: dict[int, Any], output_dir: str) -> RankDied | None:
    """The rank that failed first when it left no record of its own (None: ``exc`` says it).

    A rank that died without leaving a record (os._exit, or a signal: kill -9, the kernel's
    OOM killer) failed first; its peers then lose their connection and record that instead.
    A signal death torch noticed first is the first failure."""
    if isinstance(exc, mp.ProcessExitedException) and (exc.exit_code or 0) < 0:
        return RankDied(exc.error_index, exc.exit_code)
    if context is None:  # no rank started
        return None
    _drain(results, finished)
    # A rank that exited with code 0 before it finished (sys.exit(0), os._exit(0) in a
    # model) left its peers waiting in a collective, and they failed next: it is the cause.
    early = _exited_unfinished(context.processes, finished, results)
    if early is not None:
        return RankDied(early, 0)
    for rank, proc in enumerate(context.processes):
        record = os.path.join(output_dir, f"rank{rank}_error.json")
        died = (proc.exitcode or 0) > 0 or (proc.exitcode or 0) < 0 and _lost_peer(exc)
        if died and not os.path.exists(record):
            return RankDied(rank, proc.exitcode)
    return None


def _drain(results, finished: dict[int, Any]) -> None:
    """Read every (rank, payload) message the ranks have sent so far into ``finished``. Once
    every rank has ended the pipe reads as ended (EOFError): nothing more will come."""
    while not results.empty():
        try:
            rank, payload = results.get()
        except EOFError:
            return
        finished[rank] = payload


def _exited_unfinished(processes, finished: dict[int, Any], results) -> int | None:
    """The first rank that exited with code 0 without saying it finished, if any."""
    exited = [rank for rank, proc in enumerate(processes) if rank not in finished and proc.exitcode == 0]
    if exited:
        _drain(results, finished)  # a rank sends, then exits: what it sent is readable now
    return next((rank for rank in exited if rank not in finished), None)


def _lost_peer(exc: BaseException) -> bool:
    """Is this rank failure the loss of a peer (its connection reset or closed)?"""
    text = str(getattr(exc, "msg", "") or exc)
    return any(s in text for s in ("Connection reset", "Connection closed", "connection closed", "Broken pipe"))


class Stopped(RuntimeError):
    """The job was stopped by a signal and its ranks had to be killed."""

    def __init__(self, signum: int, killed: str | None):
        self.signum = signum
        what = f"ranks were killed ({killed})" if killed else "ranks stopped"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {what}")


class RankDied(RuntimeError):
    """A rank ended without a record of its own: killed by a signal, or exited (with code 0
    before it finished training)."""

    def __init__(self, rank: int, exit_code: int):
        if exit_code is not None and exit_code < 0:
            name = signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else "?"
            hint = (
                "; if nobody sent it, the kernel's OOM killer may have (see dmesg or journalctl -k)"
                if -exit_code == signal.SIGKILL
                else ""
            )
            message = f"rank {rank}: killed by signal {-exit_code} ({name}){hint}"
        elif exit_code == 0:
            message = (
                f"rank {rank}: the process exited with code 0 before it finished training (sys.exit or "
                "os._exit in the model or the data?)"
            )
        else:
            message = f"rank {rank}: process exited with code {exit_code}"
        super().__init__(message)


RELAY_EVERY_S = 1.0
"""Seconds between the parent's passing a stop on to its ranks again, until they end."""
SAME_DELIVERY_S = 0.5
"""The same signal again within this many seconds of the first is the same stop, delivered
twice: GNU ``timeout`` signals the job's process and then its process group, and a terminal's
Ctrl-C can reach it both ways; a second stop asked on purpose (the ranks killed at once) comes
later than that."""


class ParentStop:
    """The parent's side of stopping: SIGTERM/SIGINT are passed on to the ranks as SIGTERM
    (they finish the step, agree, save, exit); ranks still alive after ``grace_s``, or at
    a second signal, are killed, so no process outlives the job."""

    def __init__(self, grace_s: float):
        self.processes: list = []
        self.grace_s = grace_s
        self.signum: int | None = None
        self.first_at = 0.0
        """When the first signal came (monotonic)."""
        self.relayed_at = 0.0
        """When the stop was last passed on to the ranks (monotonic)."""
        self.deadline: float | None = None
        self.killed: str | None = None
        """Why the ranks were killed, if they were."""
        self.abandon: Callable[[], None] | None = None
        """Called at the first signal: what the parent waits for before releasing its ranks
        (:class:`Release`), abandoned."""

    @contextlib.contextmanager
    def handling_signals(self):
        previous = {sig: signal.signal(sig, self._on_signal) for sig in liveness.STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def watch(self, processes) -> None:
        """The ranks, once started; a signal that came while they started is passed on."""
        self.processes = processes
        if self.signum is not None:
            self._terminate()

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.first_at = time.monotonic()
            self.deadline = self.first_at + self.grace_s
            self._terminate()
            if self.abandon is not None:
                self.abandon()
        elif signum == self.signum and time.monotonic() - self.first_at < SAME_DELIVERY_S:
            return  # one signal sent to this process and to its group (GNU timeout does both)
        else:
            self._kill(f"at a second signal, {signal.Signals(signum).name}")

    def _terminate(self) -> None:
        self.relayed_at = time.monotonic()
        for proc in self.processes:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def enforce_deadline(self) -> None:
        """Called every half second while the ranks run: past the deadline, kill them; before
        it, pass the stop on again each second, for a rank that had not set its handler when
        the first came (it ignores SIGTERM until then, as the rank server it forks from does)."""
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self._kill(f"still running trainer.stop_grace_s={self.grace_s:g} s after the signal")
        elif self.signum is not None and now - self.relayed_at >= RELAY_EVERY_S:
            self.relayed_at = now
            self._terminate()

    def _kill(self, why: str) -> None:
        self.killed = self.killed or why
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
