"""A rank's entry: the job's environment, the device, the process group, then the trainer.

Runs in a process of its own, forked from the forkserver by the parent or started by
torchrun / srun. It receives the job's spec (:class:`~sharded_exp.job.spec.JobSpec`): spawned children have
no HydraConfig, and everything the parent decided (device type, memory prediction,
checkpoint plan) travels with it.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import pickle
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from sharded_exp import logs
from sharded_exp.job.result import write_json
from sharded_exp.job.spec import JobSpec
from sharded_exp.launch import forkserver
from sharded_exp.measure.host_malloc import set_malloc_rule
from sharded_exp.precision import Precision
from sharded_exp.registry import import_plugins
from sharded_exp.train import liveness

log = logging.getLogger(__name__)


def run_rank(
    job: JobSpec,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    store: dict | None = None,
    finished: Callable[[Any], None] | None = None,
) -> dict[str, Any] | None:
    """Set up this rank, train, and return rank 0's payload (None on other ranks).

    ``store``: the parent's rendezvous (host, port) for spawned ranks; None for ``env://``.
    ``finished``: told the payload as soon as training ended, before the process group is
    torn down: tearing down gloo can hang (a worker thread waits for the GIL the destructor
    holds), and a parent that already has every rank's payload then loses nothing.
    """
    liveness.catch_stop_signals()  # before anything slow: a signal now means "stop soon"
    timeline = {"rank_start": time.time()}
    for key in [k for k in os.environ if k.startswith("SHARDED_EXP_")]:
        del os.environ[key]
    os.environ.update(job.env)
    import_plugins()
    cfg = job.cfg()
    if job.device_type == "cuda":
        device = rank_device(local_rank)
        torch.cuda.set_device(device)
        check_bf16(Precision.of(cfg), device)
    else:
        device = torch.device("cpu")
        # Before the model exists: the heap reused (the default), glibc's rule, or 4 MiB (host_malloc's docstring).
        set_malloc_rule(str(cfg.trainer.host_mmap_threshold))
        # Ranks share the cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    timeout = datetime.timedelta(seconds=cfg.trainer.timeout_s)
    backend = process_group_backend(job.device_type, cfg.strategy)
    if job.device_type == "cuda":
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        launcher_env = process_environ(os.getppid()) if torchrun else {}
        os.environ.update(nccl_settings(nccl_diagnosis_env(job.output_dir), os.environ, launcher_env, torchrun))
    if store is not None:
        tcp = dist.TCPStore(store["host"], store["port"], is_master=False, timeout=timeout)
        init_group(backend, tcp, rank, world_size, timeout, device)
    else:
        # torchrun / srun: their rendezvous, with keys of their own per torchrun restart, so a
        # restarted rank never reads an address its predecessor left in a reused store.
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"sharded_exp/attempt_{attempt}/", store)
        init_group(backend, store, rank, world_size, timeout, device)
    log.debug("%s process group of %d ready on %s, %d intra-op thread(s)", backend, world_size, device,
              torch.get_num_threads())  # fmt: skip
    trained = False
    try:
        timeline["process_group_ready"] = time.time()
        # lazy: the parent imports this module to spawn ranks and never trains: the training stack stays out of it
        from sharded_exp.train.trainer import train

        released = (lambda: wait_released(tcp)) if job.wait_for_release else None  # spawned ranks only
        payload = train(job, device, timeline, released)
        if finished is not None:
            finished(payload)
        trained = True
        return payload
    except BaseException as exc:
        message = None
        if liveness.is_timeout(exc):
            try:  # name the rank that never arrived, not just "timed out"
                message = liveness.describe_timeout(exc, cfg.trainer.timeout_s)
            except Exception:  # noqa: BLE001 -- the plain error is still recorded
                pass
        record_rank_failure(job.output_dir, rank, exc, message)
        raise
    finally:
        # a spawned rank's parent kills it if this hangs (supervise); under torchrun or srun nothing would
        with teardown_deadline(None if finished is not None else cfg.trainer.stop_grace_s):
            if trained:
                from sharded_exp.train import faults  # lazy: (as above) the training stack

                faults.hang_at_exit(rank)  # the testing aid: a teardown that never ends
            dist.destroy_process_group()


RELEASE_KEY = "sharded_exp/released"
"""The rendezvous store's key the parent releases its spawned ranks by (:func:`release_ranks`)."""


def release_ranks(store, word: Any) -> None:
    """Release the ranks waiting in :func:`wait_released` with ``word`` (the peak prediction)."""
    store.set(RELEASE_KEY, pickle.dumps(word))


def wait_released(store) -> Any:
    """What the parent released this rank with (:attr:`JobSpec.wait_for_release`), once it has:
    however long its prediction takes (a rank it refuses is killed; one whose parent is gone
    exits, :func:`~sharded_exp.launch.forkserver.watch_parent`)."""
    store.wait([RELEASE_KEY], datetime.timedelta(days=7))
    return pickle.loads(store.get(RELEASE_KEY))


@contextlib.contextmanager
def teardown_deadline(limit_s: float | None):
    """Exit the process with code 1, every thread's stack written to stderr, if the block
    has not ended ``limit_s`` seconds after it began (None: no deadline).

    Tearing a gloo process group down can hang: its destructor waits for a thread that waits
    for the GIL the destructor holds. A Python thread could not end it (it needs that GIL);
    faulthandler's watchdog is a thread of C that needs none. Only for a rank that an external
    launcher started (torchrun, srun), which would otherwise wait forever: its launcher then
    sees the rank fail. A spawned rank's parent already kills it (it holds the payload)."""
    if limit_s is None:
        yield
        return
    faulthandler.dump_traceback_later(limit_s, exit=True)  # the stacks say where: destroy_process_group
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def process_group_backend(device_type: str, strategy_cfg) -> str:
    """NCCL on CUDA, gloo on CPU; under CPU offload NCCL for CUDA tensors and gloo for CPU ones
    (torchtitan's ``cuda:nccl,cpu:gloo`` when it offloads): the offloaded gradients are host
    DTensors, and clipping them reduces their norm over the mesh, which NCCL cannot do on the
    CPU."""
    from sharded_exp.strategies import offloads_to_host  # lazy: the parent imports this module and never trains

    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offloads_to_host(strategy_cfg) else "nccl"


def init_group(backend: str, store, rank: int, world_size: int, timeout, device: torch.device) -> None:
    """The default process group. On CUDA it is bound to this rank's GPU (``device_id``):
    NCCL then makes its communicator now, for that device, instead of guessing the device
    at each barrier and making one per pair of ranks at the first point-to-point send (the
    consolidated checkpoint's)."""
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound)


def rank_device(local_rank: int) -> torch.device:
    """This rank's GPU among the visible ones: ``cuda:<local_rank>`` when each rank sees
    them all, ``cuda:0`` when the launcher gave each task its own (``srun
    --gpus-per-task=1``: one visible GPU, whatever the local rank)."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_bf16(precision_name: str, device: torch.device) -> None:
    """precision=bf16 needs bfloat16 in the GPU's hardware (Ampere or later): on V100 or T4
    torch emulates it, slowly, which a memory and speed study must not measure."""
    if precision_name == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"precision=bf16 is not supported natively by GPU {device.index} ({name}; torch would emulate it); "
            "use precision=16 or 32"
        )


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (Linux), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    return dict(item.decode(errors="replace").partition("=")[::2] for item in items if b"=" in item)


def nccl_settings(ours: dict[str, str], env, launcher_env: dict[str, str] | None, torchrun: bool) -> dict[str, str]:
    """Which of ``ours`` to set: each one the user did not set. Under torchrun the elastic
    agent exports ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` to every rank whether or not the
    user set it; it is the user's only if torchrun itself was started with it
    (``launcher_env``, torchrun's own environment). Unknown (unreadable): theirs wins."""
    out = {}
    for key, value in ours.items():
        if key not in env:
            out[key] = value
        elif (
            torchrun
            and key == "TORCH_NCCL_ASYNC_ERROR_HANDLING"
            and launcher_env is not None
            and key not in launcher_env
        ):
            out[key] = value  # torchrun's default, not the user's choice
    return out


def nccl_diagnosis_env(output_dir: str) -> dict[str, str]:
    """NCCL settings that let a hang be diagnosed, set unless the user set them.

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: on a collective timeout the communicator is
      aborted but the process is not torn down (torch's default, 3, kills it), so the
      timeout reaches this rank's ``except`` and the rank that did not arrive is named, as
      on gloo.
    - The flight recorder: the last collectives of every rank, dumped on a timeout into
      the run directory as ``nccl_trace_rank_<r>``; read them with ``torchfrtrace``.
    """
    prefix = os.path.join(output_dir, "nccl_trace_rank_")
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # the name older torch versions read
    }


def spawned_entry(index: int, world_size: int, job: JobSpec, store: dict, results) -> None:
    """Entry of a rank spawned by the parent; ``index`` is the rank (one machine)."""
    logs.setup_rank(index, job.log_file, job.log_level)
    if job.parent_pid is not None:
        forkserver.watch_parent(job.parent_pid)
    # Every rank says it finished, rank 0 with the payload, before its process group is torn down.
    run_rank(job, index, world_size, index, world_size, store, finished=lambda payload: results.put((index, payload)))


def record_rank_failure(output_dir: str, rank: int, exc: BaseException, message: str | None = None) -> None:
    """Keep a failing rank's traceback, with the time it failed, in the output directory.

    When one rank fails its peers fail next ("connection reset by peer"), and which one the
    launcher reports first is a race; the earliest record names the rank that started it.
    """
    write_json(
        os.path.join(output_dir, f"rank{rank}_error.json"),
        {
            "rank": rank,
            "time": time.time(),
            "error": f"rank {rank}: " + (message or "".join(traceback.format_exception_only(type(exc), exc)).strip()),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            # Out of memory: what this rank held then (set by the trainer on the exception).
            "memory_at_oom": getattr(exc, "memory_at_oom", None),
            # the training step it was in (-1: before the first, in the build or a resume), and
            # the steps it had completed (None: none yet), which a failure between steps or
            # after the loop (a checkpoint, the final evaluation) has all done
            "step": liveness.current_step,
            "steps_done": liveness.steps_done,
        },
    )
