"""The parent: the Hydra job's side of a job, from pre-flight to ``result.json``.

It checks the config once (:mod:`sharded_exp.launch.preflight`), then either

- spawns ``trainer.world_size`` rank processes that rendezvous through a TCPStore the
  parent itself holds on a free port (so two jobs on one machine never collide), and
  supervises them: the first failure, SIGTERM/SIGINT passed on, no orphans; or
- when started by torchrun or srun (:mod:`.layout`), runs as that one rank.

``result.json`` is written here, through its one writer (:func:`sharded_exp.job.result.write_result`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from sharded_exp.checkpoint.plan import archive_later
from sharded_exp.checkpoint.storage import (
    complete_checkpoints,
    hold_checkpoint_dir,
    hold_directory,
    next_numbered,
    remove_unfinished_saves,
)
from sharded_exp.errors import OOM_SIGNS, RunDirInUse, WontFit, writing
from sharded_exp.job.result import TRAINED, PartialResult, Result, read_json, write_result
from sharded_exp.job.spec import JobSpec
from sharded_exp.launch import forkserver, preflight
from sharded_exp.launch.layout import Layout, external_layout, rendezvous_env
from sharded_exp.launch.rank import run_rank, spawned_entry
from sharded_exp.measure.tracker import MemoryMeter
from sharded_exp.output.results import (
    base_result,
    finished_result,
    memory_lines,
    oom_memory,
    predicted_section,
    summary_table,
)
from sharded_exp.registry import import_plugins
from sharded_exp.train import liveness

log = logging.getLogger(__name__)


def launch(
    cfg: DictConfig,
    output_dir: str,
    job_files: dict[str, Any] | None = None,
    started: tuple[float, float] | None = None,
    identity: dict[str, Any] | None = None,
) -> Result:
    """Check, run every rank, write ``result.json`` and print the summary table.

    Returns the result; its ``status`` is "ok", "stopped" (by a signal), "oom" or
    "failed" (with ``error`` naming the rank). Raises ConfigError before any rank starts.
    Under torchrun only rank 0 writes and prints. ``job_files``: ``.hydra/`` files to
    write once the config is known good. ``identity``: result.json fields that place the
    job in its sweep (``overrides``, ``sweep_id``, see :func:`sharded_exp.report`).
    """
    import_plugins()
    launched = time.time()
    layout = external_layout()
    is_writer = layout is None or layout.rank == 0
    # A directory that exists may be another live job's: refused at once, before anything
    # is checked or written. A new one is made (and held) once the config is known good.
    lock = hold_run_dir(output_dir) if is_writer and os.path.isdir(output_dir) else None
    try:
        return _launch(cfg, output_dir, job_files, started, layout, is_writer, launched, lock, identity or {})
    finally:
        release_run_dir(lock)


launch_locks: list = []


def release_run_dir(lock) -> None:
    """Let the run directory go: the lock file is removed, then the lock released."""
    for held in [lock, *launch_locks]:
        if held is None or held.closed:
            continue
        with contextlib.suppress(OSError):
            os.remove(held.name)
        held.close()
    launch_locks.clear()


def hold_run_dir(output_dir: str):
    """Hold ``output_dir`` for this job (an exclusive lock on ``<output_dir>/.lock``, which
    names our pid; released when this process ends, however it ends). A second live job
    there is refused at once, before it moves or writes anything."""
    return hold_directory(output_dir, lambda owner: RunDirInUse(
        f"run directory {output_dir} is in use by a running job (pid {owner}); wait for it to end "
        "or choose another hydra.run.dir"
    ))  # fmt: skip


def _launch(cfg, output_dir, job_files, started, layout, is_writer, launched, lock, identity) -> Result:
    spec = preflight.check(cfg, output_dir, layout, peak=is_writer)  # raises ConfigError before any rank starts
    result = base_result(
        spec.config, spec.params, output_dir, **identity, launcher=spec.launcher, zero_grad=spec.zero_grad.record()
    )
    if is_writer and spec.zero_grad.reason:  # trainer.zero_grad not honoured: said, not silent
        log.warning(
            "note: trainer.zero_grad=%s is not honoured: %s", spec.zero_grad.requested.value, spec.zero_grad.reason
        )
    os.makedirs(output_dir, exist_ok=True)
    if is_writer and lock is None:
        lock = hold_run_dir(output_dir)
        launch_locks.append(lock)  # released by launch()
    if is_writer and spec.checkpoint.every:
        launch_locks.append(hold_checkpoint_dir(spec.checkpoint.directory))
        for stale in remove_unfinished_saves(spec.checkpoint.directory):  # ours now: no other job writes there
            log.warning("removed %s: the temporary directory of a save that never finished", stale)
        archive_later(spec.checkpoint)
    if is_writer:
        archive_previous_attempt(output_dir, extra=(".hydra",) if job_files else ())
        if job_files and spec.config_yaml:  # the config as decided (world size, checkpoint paths)
            job_files = {**job_files, "config.yaml": OmegaConf.create(spec.config_yaml)}
        write_job_files(output_dir, job_files or {})
        # Status "running" with the prediction: what to expect is on disk before any rank starts.
        write_result(output_dir, result.updated(memory=predicted_section(spec.prediction)))
    if is_writer:
        peaks = (spec.prediction.get("peak") or {}).get("per_rank_mib")
        peak = f", predicted peak {max(peaks):.2f} MiB per rank" if peaks else ""
        log.info("%s x%d on %s (%s), %s parameters%s; output in %s", spec.config["strategy"]["name"],
                 spec.world_size, spec.device_type, spec.launcher, f"{spec.params:,}", peak, output_dir)  # fmt: skip
    try:
        validated = time.time()
        # rank 0's payload carries status "ok" or "stopped"; other torchrun ranks get None
        payload = run_ranks(spec, layout)
        main, imported = started or (None, None)
        parent_times = {"main": main, "imported": imported, "launch": launched, "validated": validated}
        result = finished_result(result, payload, parent_times)
    except Exception as exc:  # noqa: BLE001 -- a rank failed: record it, then let the caller exit non-zero
        # what training measured before a failure in the final pass, then how it failed
        result = failed(result.updated(**kept_training(output_dir)), exc, output_dir)
        applies = MemoryMeter.LIMIT_APPLIES_TO[spec.device_type] if cfg.trainer.memory_limit_mib else None
        if not result.has("memory"):  # what was expected, still
            result = result.updated(memory=predicted_section(spec.prediction, applies))
        if result.status == "oom":  # what the ranks that ran out held (from their error records)
            memory = result.as_written()["memory"]
            result = result.updated(memory={**memory, **oom_memory(rank_failures(output_dir))})
        if spec.checkpoint.every or isinstance(exc, Stopped):
            # stopped, killed or failed mid-way (in a save too): the newest complete checkpoint is the one to resume
            directory = spec.checkpoint.directory
            found = complete_checkpoints(directory) if directory and os.path.isdir(directory) else []
            result = result.updated(checkpoint=found[-1][1] if found else None)
    if is_writer:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(output_dir, TRAINED))
        write_result(output_dir, result)
        log.info("finished: %s%s", result.status, f" ({result.error})" if result.error else "")
        print(summary_table(result), flush=True)
        for line in memory_lines(result):
            print(line, flush=True)
        print(f"output: {output_dir}", flush=True)
    return result


def record_config_error(
    cfg: DictConfig, output_dir: str, exc: Exception, what: str = "config", identity: dict[str, Any] | None = None
) -> Result:
    """A sweep point whose config was refused (``what`` "config"), or that failed
    unexpectedly around its ranks ("unexpected", with the traceback): recorded as a
    failed point, so that every point of a sweep ends with a result.json."""
    archive_previous_attempt(output_dir)
    try:
        data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001 -- a config that cannot resolve: kept as written
        data = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    error = f"config: {exc}" if what == "config" else f"unexpected: {type(exc).__name__}: {exc}"
    status = "oom" if isinstance(exc, WontFit) else "failed"  # predicted not to fit: a result
    result = base_result(data, None, output_dir, status, error, **(identity or {}))
    if what != "config":
        result = result.updated(traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    write_result(output_dir, result)
    return result


def run_ranks(job: JobSpec, layout: Layout | None) -> PartialResult | None:
    """Run the job's ranks: spawn them, or be the one rank an external launcher started."""
    if layout is None:
        return spawn(job, job.world_size)
    for key, value in rendezvous_env(layout).items():
        os.environ.setdefault(key, value)
    entry = run_rank
    if layout.launcher == "torchrun":
        # torchrun's own error file: its summary then names this rank's exception as the root cause.
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(run_rank)
    return entry(job, layout.rank, layout.world_size, layout.local_rank, layout.local_world_size)


def spawn(job: JobSpec, world_size: int) -> PartialResult:
    """Run ``world_size`` ranks as child processes; return rank 0's payload or raise."""
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
    try:
        with stop.handling_signals():  # before the ranks exist: no signal leaves orphans
            context = mp.start_processes(
                spawned_entry,
                args=(world_size, job, store_addr, results),
                nprocs=world_size,
                start_method="forkserver",
                join=False,
            )
            stop.watch(context.processes)
            # When a rank fails, its peers get 2 s to exit by themselves, then SIGTERM,
            # 2 s more, then SIGKILL (torch's default would wait 30 s). Every rank says it
            # finished, rank 0 with its payload; messages are read as soon as they are sent:
            # a payload larger than the pipe's buffer (a long history) blocks rank 0 in
            # put() until read, and it would never exit.
            while not context.join(timeout=0.5, grace_period=2.0):
                _drain(results, finished)
                early = _exited_unfinished(context.processes, finished, results)
                if early is not None:  # its peers wait for it in a collective: no need to wait on
                    raise RankDied(early, 0)
                stop.enforce_deadline()
            _drain(results, finished)
    except Exception:
        if stop.signum is not None:  # ranks that died of the signal, or were killed
            raise Stopped(stop.signum, killed=stop.killed) from None
        # A rank that died without leaving a record (os._exit, or a signal: kill -9, the
        # kernel's OOM killer) failed first; its peers then lose their connection and
        # record that instead. A signal death torch noticed first is the first failure.
        exc = sys.exc_info()[1]
        if isinstance(exc, RankDied):
            raise
        if isinstance(exc, mp.ProcessExitedException) and (exc.exit_code or 0) < 0:
            raise RankDied(exc.error_index, exc.exit_code) from None
        _drain(results, finished)
        # A rank that exited with code 0 before it finished (sys.exit(0), os._exit(0) in a
        # model) left its peers waiting in a collective, and they failed next: it is the cause.
        early = _exited_unfinished(context.processes, finished, results)
        if early is not None:
            raise RankDied(early, 0) from None
        for rank, proc in enumerate(context.processes):
            record = os.path.join(job.output_dir, f"rank{rank}_error.json")
            died = (proc.exitcode or 0) > 0 or (proc.exitcode or 0) < 0 and _lost_peer(exc)
            if died and not os.path.exists(record):
                raise RankDied(rank, proc.exitcode) from None
        raise
    early = _exited_unfinished(context.processes, finished, results)
    if early is not None:  # every rank exited with code 0, and this one never finished
        raise RankDied(early, 0)
    payload = finished[0]
    if payload.status == "stopped" and stop.signum is not None:
        payload = payload.updated(signal=stop.signum)  # the job's signal (ranks may also see Ctrl-C's SIGINT)
    return payload


def _drain(results, finished: dict[int, Any]) -> None:
    """Read every (rank, payload) message the ranks have sent so far into ``finished``."""
    while not results.empty():
        rank, payload = results.get()
        finished[rank] = payload


def _exited_unfinished(processes, finished: dict[int, Any], results) -> int | None:
    """The first rank that exited with code 0 without saying it finished, if any."""
    exited = [rank for rank, proc in enumerate(processes) if rank not in finished and proc.exitcode == 0]
    if exited:
        _drain(results, finished)  # a rank sends, then exits: what it sent is readable now
    return next((rank for rank in exited if rank not in finished), None)


class Stopped(RuntimeError):
    """The job was stopped by a signal and its ranks had to be killed."""

    def __init__(self, signum: int, killed: str | None):
        self.signum = signum
        what = f"ranks were killed ({killed})" if killed else "ranks stopped"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {what}")


class ParentStop:
    """The parent's side of stopping: SIGTERM/SIGINT are passed on to the ranks as SIGTERM
    (they finish the step, agree, save, exit); ranks still alive after ``grace_s``, or at
    a second signal, are killed, so no process outlives the job."""

    def __init__(self, grace_s: float):
        self.processes: list = []
        self.grace_s = grace_s
        self.signum: int | None = None
        self.deadline: float | None = None
        self.killed: str | None = None
        """Why the ranks were killed, if they were."""

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
            self.deadline = time.monotonic() + self.grace_s
            self._terminate()
        else:
            self._kill(f"at a second signal, {signal.Signals(signum).name}")

    def _terminate(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def enforce_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self._kill(f"still running trainer.stop_grace_s={self.grace_s:g} s after the signal")

    def _kill(self, why: str) -> None:
        self.killed = self.killed or why
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()


def _lost_peer(exc: BaseException) -> bool:
    """Is this rank failure the loss of a peer (its connection reset or closed)?"""
    text = str(getattr(exc, "msg", "") or exc)
    return any(s in text for s in ("Connection reset", "Connection closed", "connection closed", "Broken pipe"))


class RankDied(RuntimeError):
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


def kept_training(output_dir: str) -> dict[str, Any]:
    """Rank 0's training figures when the job failed after training (in the final evaluation),
    without its status; {} when there are none."""
    try:
        kept = read_json(os.path.join(output_dir, TRAINED))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if k not in ("status", "error", "traceback", "timeline")}


def failed(result: Result, exc: BaseException, output_dir: str) -> Result:
    """``result`` with the status and error of a job whose ranks failed or were stopped."""
    first = None if isinstance(exc, (RankDied, Stopped)) else first_rank_failure(output_dir)
    if first is not None:
        result = result.updated(status="failed", error=first["error"], traceback=first["traceback"])
    else:
        result = result.updated(status="failed", error=describe_failure(exc))
    if isinstance(exc, Stopped):
        result = result.updated(status="stopped", signal=exc.signum)
    if any(sign in result.error for sign in OOM_SIGNS):
        result = result.updated(status="oom")  # a result, not a crash: this point does not fit
    return result


def rank_failures(output_dir: str) -> list[dict[str, Any]]:
    """The rank failures recorded in ``output_dir``, earliest first."""
    records = []
    for name in os.listdir(output_dir):
        if name.startswith("rank") and name.endswith("_error.json"):
            with open(os.path.join(output_dir, name)) as f:
                records.append(json.load(f))
    return sorted(records, key=lambda r: r["time"])


def first_rank_failure(output_dir: str) -> dict[str, Any] | None:
    """The earliest rank failure recorded in ``output_dir``, if any."""
    records = rank_failures(output_dir)
    return records[0] if records else None


def describe_failure(exc: BaseException) -> str:
    """One line naming the failing rank and its exception."""
    if isinstance(exc, (RankDied, Stopped)):
        return str(exc)
    if isinstance(exc, mp.ProcessRaisedException):
        last = [line for line in exc.msg.strip().splitlines() if line.strip()][-1]
        return f"rank {exc.error_index}: {last.strip()}"
    if isinstance(exc, mp.ProcessExitedException):
        return f"rank {exc.error_index}: process exited with code {exc.exit_code}"
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def write_job_files(output_dir: str, files: dict[str, Any]) -> None:
    """The composed config, Hydra's config and the overrides, as Hydra would write them."""
    for name, content in files.items():
        os.makedirs(os.path.join(output_dir, ".hydra"), exist_ok=True)
        with writing(os.path.join(output_dir, ".hydra", name)):
            OmegaConf.save(content, os.path.join(output_dir, ".hydra", name))


def archive_previous_attempt(output_dir: str, extra: tuple[str, ...] = ()) -> str | None:
    """Move an earlier attempt's records (result.json, rank errors, ``extra``) in a reused
    output directory to ``attempts/<n>/``: a new run deletes and overwrites nothing.
    Checkpoints stay where they are (a resumed run reads them)."""
    if not os.path.isdir(output_dir):
        return None
    names = [
        n
        for n in os.listdir(output_dir)
        if n == "result.json" or (n.startswith("rank") and n.endswith("_error.json")) or n in extra
    ]
    if not names:
        return None
    target = next_numbered(os.path.join(output_dir, "attempts"))
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(target, name))
    return target
