"""Helpers for benchmarks: run real jobs in-process from the real config tree."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.limits import COMMAND_TIMEOUT_S
from sharded_exp.compose import compose
from sharded_exp.launch.parent import launch
from sharded_exp.measure.spawned import run_spawned

OUT = Path("outputs/benchmarks")


def command_env(bytecode_cache: bool = True, checkout: str | None = None) -> Dict[str, str]:
    """The environment a timed ``python -m sharded_exp`` runs in: this process's, with Python's
    bytecode cache as a user's Python has it (``bytecode_cache``): on, even where this machine
    turns it off (this project's machines and CI set PYTHONDONTWRITEBYTECODE=1; Python's default
    writes ``__pycache__``). Without the cache each process of a job (the parent, the rank server;
    the ranks fork from the server) compiles the package from source: ``compile()`` of all of
    its modules took 0.32 s in one process here (2026-12-07).

    ``bytecode_cache=False``: as this machine ran it before the test suite wrote a cache:
    ``checkout``'s (None: this one's) ``sharded_exp/**/__pycache__`` deleted, and none written.
    The flag only stops writing: a cache already there would be read."""
    out = dict(os.environ)
    if bytecode_cache:
        out.pop("PYTHONDONTWRITEBYTECODE", None)
        return out
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    for cache in sorted(Path(checkout or ".", "sharded_exp").rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    return out


def strategy_names() -> List[str]:
    """Every registered strategy (``STRATEGIES.names()``), the modules SHARDED_EXP_PLUGINS
    names imported first: what a benchmark runs by default, so that a new strategy, or a
    plugin's, is measured without editing a list here."""
    from sharded_exp.registry import import_plugins
    from sharded_exp.strategies import STRATEGIES

    import_plugins()
    return STRATEGIES.names()


def run(overrides: List[str], name: str, root: Path = OUT, check: bool = True) -> Dict[str, Any]:
    """Compose and launch one job in ``root / name``; raises unless it ends "ok" (``check``)."""
    cfg = compose(overrides)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    result = launch(cfg, str(out)).as_written()
    if check and result["status"] != "ok":
        raise RuntimeError(f"{name}: {result['error']}")
    return result


def markdown(header: List[str], rows: List[List[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, data: Any) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def spawn_ranks(fn, world_size: int, *args) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks, as a hand-written
    script would (forkserver processes, a TCP rendezvous, one thread share per rank, like
    the launcher); returns rank 0's return value."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    queue = ctx.SimpleQueue()
    port = free_port()
    got = []

    def done() -> bool:  # rank 0's value, read as soon as it is sent (it may not fit the pipe's buffer)
        if not got and not queue.empty():
            got.append(queue.get())
        return bool(got)

    # never waited for forever: ranks stuck tearing gloo down after rank 0 sent its value are killed
    run_spawned(_rank_entry, (world_size, port, fn, args, queue), world_size, done, "benchmark ranks",
                limit_s=COMMAND_TIMEOUT_S, start_method="forkserver")  # fmt: skip
    return got[0]


def free_port() -> int:
    """A TCP port free on this machine now (a rendezvous for ranks started by hand or by a test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(out)  # before the teardown, which can hang
    finally:
        dist.destroy_process_group()
