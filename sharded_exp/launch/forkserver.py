"""The forkserver that rank processes are forked from, started as early as possible.

Rank processes fork from a clean server process that imported torch and sharded_exp once
(plain fork would inherit the parent's OpenMP pool and deadlock; CUDA cannot be forked
after initialisation). Importing takes seconds, so ``python -m sharded_exp`` starts the
server before it imports anything heavy itself: both import in parallel. This module
imports only the standard library for that reason.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

from sharded_exp.launch.layout import will_spawn

PRELOAD = ["sharded_exp.train.trainer", "sharded_exp.strategies", "torch._dynamo"]
"""Imported once by the server: the trainer, every strategy, and torch._dynamo, which
DistributedDataParallel would otherwise import in every rank (about a second each)."""


def context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the server now (it imports in the background) if this job will spawn ranks."""
    if will_spawn():
        context()
        multiprocessing.forkserver.ensure_running()
