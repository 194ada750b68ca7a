"""Start the ranks of one job and collect its result.

The Hydra job is the parent process. It validates the config once, then either

- spawns ``trainer.world_size`` rank processes that rendezvous through a TCPStore the
  parent itself holds on a free port (so two jobs on one machine never collide), or
- when started by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set), runs as that one
  rank and joins the ``env://`` rendezvous torchrun prepared.

Ranks receive the resolved config as plain data: spawned children have no HydraConfig.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import re
import signal
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from sharded_exp import forkserver, liveness


def torchrun_env() -> dict[str, int] | None:
    """Rank layout set by an external launcher (torchrun or SLURM), or None if we must spawn."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", "0")),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        }
    return slurm_layout(env)


def slurm_layout(env) -> dict[str, int] | None:
    """Rank layout of a SLURM job step (srun, or hydra/launcher=submitit_slurm): tasks are ranks.

    Used only inside a job step with several tasks; a lone ``python -m sharded_exp`` in an
    allocation still spawns its own ranks. The rendezvous is the step's first node, on a
    port derived from the job id; the variables are exported for ``env://``.
    """
    if "SLURM_STEP_ID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return None
    world_size = int(env["SLURM_NTASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    os.environ.setdefault("MASTER_ADDR", first_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))))
    os.environ.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return {
        "rank": int(env["SLURM_PROCID"]),
        "world_size": world_size,
        "local_rank": int(env.get("SLURM_LOCALID", "0")),
        "local_world_size": max(1, world_size // nodes),
    }


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        return "127.0.0.1"
    prefix, ranges = head.group(1), head.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


PLUGINS_ENV = "SHARDED_EXP_PLUGINS"


def _job_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("SHARDED_EXP_")}


def import_plugins() -> None:
    """Import the modules named in SHARDED_EXP_PLUGINS (comma-separated).

    Out-of-tree strategies, models or data tasks register themselves on import; every
    rank and the validating parent must import them.
    """
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(name)


def resolve_device(accelerator: str) -> str:
    """'cuda' or 'cpu' for trainer.accelerator (validated before this is called)."""
    if accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def _run_rank(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    cfg_data: dict[str, Any],
    output_dir: str,
    store: dict[str, Any] | None,
    results: Any,
    env: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    # Forked from the forkserver, a rank inherits the server's environment, not the job's:
    # the job's SHARDED_EXP_* variables are passed explicitly and replace the server's.
    liveness.catch_stop_signals()  # before anything slow: a signal now means "stop soon"
    timeline = {"rank_start": time.time()}
    if env is not None:
        for key in [k for k in os.environ if k.startswith("SHARDED_EXP_")]:
            del os.environ[key]
        os.environ.update(env)
    import_plugins()
    cfg = OmegaConf.create(cfg_data)
    device_type = resolve_device(cfg.trainer.accelerator)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ranks share the cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    timeout = datetime.timedelta(seconds=cfg.trainer.timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if store is not None:
        tcp = dist.TCPStore(store["host"], store["port"], is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=tcp, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    try:
        timeline["process_group_ready"] = time.time()
        from sharded_exp.trainer import train  # here, not at the top: the parent never trains

        payload = train(cfg, device, output_dir, timeline)
    except BaseException as exc:
        message = None
        if liveness.is_timeout(exc):
            try:  # name the rank that never arrived, not just "timed out"
                message = liveness.describe_timeout(exc, cfg.trainer.timeout_s)
            except Exception:  # noqa: BLE001 -- the plain error is still recorded
                pass
        record_rank_failure(output_dir, rank, exc, message)
        raise
    finally:
        dist.destroy_process_group()
    if results is not None and payload is not None:
        results.put(payload)
    return payload


def spawn(cfg_data: dict[str, Any], world_size: int, output_dir: str) -> dict[str, Any]:
    """Run ``world_size`` ranks as child processes; return rank 0's payload or raise."""
    # forkserver: children fork from a clean server process that imported torch once, so a
    # sweep pays the import once; plain fork would inherit the parent's OpenMP pool (and
    # deadlock), and CUDA cannot be forked after initialisation.
    start_method = "forkserver"
    ctx = forkserver.context()  # usually running already: started by __main__ before its imports
    results = ctx.SimpleQueue()
    timeout = datetime.timedelta(seconds=cfg_data["trainer"]["timeout_s"])
    # The parent holds the rendezvous store on a port the OS picks: no collisions.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store_addr = {"host": "127.0.0.1", "port": store.port}
    stop = ParentStop(cfg_data["trainer"]["stop_grace_s"])
    try:
        with stop.handling_signals():  # before the ranks exist: no signal leaves orphans
            context = mp.start_processes(
                _spawned_entry,
                args=(world_size, cfg_data, output_dir, store_addr, results, _job_env()),
                nprocs=world_size,
                start_method=start_method,
                join=False,
            )
            stop.watch(context.processes)
            # When a rank fails, its peers get 2 s to exit by themselves, then SIGTERM,
            # 2 s more, then SIGKILL (torch's default would wait 30 s).
            while not context.join(timeout=0.5, grace_period=2.0):
                stop.enforce_deadline()
    except Exception:
        if stop.signum is not None:  # ranks that died of the signal, or were killed
            raise Stopped(stop.signum, killed=stop.killed) from None
        # A rank that exited non-zero without leaving a record died without raising
        # (os._exit, killed): it, not the peers that then lost their connection, failed first.
        for rank, proc in enumerate(context.processes):
            record = os.path.join(output_dir, f"rank{rank}_error.json")
            if (proc.exitcode or 0) > 0 and not os.path.exists(record):
                raise RankDied(rank, proc.exitcode) from None
        raise
    payload = results.get()
    if payload.get("status") == "stopped" and stop.signum is not None:
        payload["signal"] = stop.signum  # the job's signal (ranks may also see Ctrl-C's SIGINT)
    return payload


class Stopped(RuntimeError):
    """The job was stopped by a signal and its ranks had to be killed."""

    def __init__(self, signum: int, killed: bool):
        self.signum = signum
        what = "ranks were killed after trainer.stop_grace_s" if killed else "ranks stopped"
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
        self.killed = False

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
            self._kill()

    def _terminate(self) -> None:
        for proc in self.processes:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def enforce_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self._kill()

    def _kill(self) -> None:
        self.killed = True
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()


class RankDied(RuntimeError):
    def __init__(self, rank: int, exit_code: int):
        super().__init__(f"rank {rank}: process exited with code {exit_code}")


def _spawned_entry(rank, world_size, cfg_data, output_dir, store, results, env):
    # start_processes passes the process index first; on one machine it is the local rank.
    _run_rank(rank, world_size, rank, world_size, cfg_data, output_dir, store, results, env)


def record_rank_failure(output_dir: str, rank: int, exc: BaseException, message: str | None = None) -> None:
    """Keep a failing rank's traceback, with the time it failed, in the output directory.

    When one rank fails its peers fail next ("connection reset by peer"), and which one the
    launcher reports first is a race; the earliest record names the rank that started it.
    """
    from sharded_exp.results import write_json

    write_json(
        os.path.join(output_dir, f"rank{rank}_error.json"),
        {
            "rank": rank,
            "time": time.time(),
            "error": f"rank {rank}: " + (message or "".join(traceback.format_exception_only(type(exc), exc)).strip()),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        },
    )


def first_rank_failure(output_dir: str) -> dict[str, Any] | None:
    """The earliest rank failure recorded in ``output_dir``, if any."""
    records = []
    for name in os.listdir(output_dir):
        if name.startswith("rank") and name.endswith("_error.json"):
            with open(os.path.join(output_dir, name)) as f:
                records.append(json.load(f))
    return min(records, key=lambda r: r["time"]) if records else None


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
        OmegaConf.save(content, os.path.join(output_dir, ".hydra", name))


def run_job(cfg: DictConfig, output_dir: str) -> dict[str, Any]:
    """Run one job (all its ranks) and return rank 0's payload; raises if a rank failed."""
    cfg_data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    env = torchrun_env()
    if env is None:
        return spawn(cfg_data, cfg.trainer.world_size, output_dir)
    return _run_rank(
        env["rank"], env["world_size"], env["local_rank"], env["local_world_size"], cfg_data, output_dir, None, None
    )


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
    attempts = os.path.join(output_dir, "attempts")
    os.makedirs(attempts, exist_ok=True)
    target = os.path.join(attempts, str(len(os.listdir(attempts)) + 1))
    os.makedirs(target)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(target, name))
    return target


def launch(
    cfg: DictConfig,
    output_dir: str,
    job_files: dict[str, Any] | None = None,
    started: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Validate, run every rank, write ``result.json`` and print the summary table.

    Returns the result; its ``status`` is "ok", "stopped" (by a signal), "oom" or
    "failed" (with ``error`` naming the rank). Under torchrun only rank 0 writes and
    prints. ``job_files``: ``.hydra/`` files to write once the config is known good.
    """
    from sharded_exp.config import resolve_checkpoints, validate
    from sharded_exp.results import base_result, summary_table, write_json

    import_plugins()
    launched = time.time()
    params = validate(cfg)  # raises ConfigError before any rank starts
    resolve_checkpoints(cfg, output_dir)  # likewise, naming a bad checkpoint file
    cfg_data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    env = torchrun_env()
    if env is not None:
        cfg_data["trainer"]["world_size"] = env["world_size"]
    is_writer = env is None or env["rank"] == 0
    result = base_result(cfg_data, params, output_dir)
    if is_writer:
        archive_previous_attempt(output_dir, extra=(".hydra",) if job_files else ())
        write_job_files(output_dir, job_files or {})
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "result.json")
    try:
        # rank 0's payload carries status "ok" or "stopped"; other torchrun ranks get None
        validated = time.time()
        result.update(run_job(cfg, output_dir) or {"status": "ok"})
        # Unix times: parent launch -> validated -> rank start -> process group -> built -> logger -> first step
        main, imported = started or (None, None)
        result["timeline"] = {
            "main": main,
            "imported": imported,
            "launch": launched,
            "validated": validated,
            **result.get("timeline", {}),
        }
    except Exception as exc:  # noqa: BLE001 -- a rank failed: record it, then let the caller exit non-zero
        first = None if isinstance(exc, (RankDied, Stopped)) else first_rank_failure(output_dir)
        if first is not None:
            result.update(status="failed", error=first["error"], traceback=first["traceback"])
        else:
            result.update(status="failed", error=describe_failure(exc))
        if isinstance(exc, Stopped):
            result.update(status="stopped", signal=exc.signum)
        if "OutOfMemoryError" in result["error"]:
            result["status"] = "oom"  # a result, not a crash: this point does not fit
    if is_writer:
        write_json(path, result)
        print(summary_table(result), flush=True)
    return result
