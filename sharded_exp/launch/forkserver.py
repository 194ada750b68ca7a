"""The forkserver that rank processes are forked from, started as early as possible.

Rank processes fork from a clean server process that imported torch and sharded_exp once
(plain fork would inherit the parent's OpenMP pool and deadlock; CUDA cannot be forked
after initialisation). Importing takes seconds, so ``python -m sharded_exp`` starts the
server before it imports anything heavy itself: both import in parallel. This module
imports only the standard library for that reason.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

from sharded_exp.launch.layout import will_spawn

PRELOAD = [
    "sharded_exp.launch.server_init",
    "sharded_exp.train.trainer",
    "sharded_exp.strategies",
    "torch._dynamo",
    "torch.distributed.optim",
]
"""Imported once by the server: its signal settings, the trainer, every strategy, torch._dynamo, which
DistributedDataParallel would otherwise import in every rank (about a second each), and
torch.distributed.optim, which zero1 imports when it builds (0.2 s; the parent, which imports
the strategies for their schemas only, never does). Not torchmetrics: the evaluation pass
computes its definitions in plain torch (train/evaluate.py)."""


HF_MODELING = {
    "hf_bert": "transformers.models.bert.modeling_bert",
    "hf_gpt2": "transformers.models.gpt2.modeling_gpt2",
    "hf_llama": "transformers.models.llama.modeling_llama",
}
"""Hugging Face modeling modules by model option prefix: several seconds of imports that the
server does while the parent composes and checks the config, not every rank after it."""


def extra_preload(args: list[str]) -> list[str]:
    """Modules the chosen model needs, read from the command line (``model=hf_bert...``)."""
    for arg in args:
        if arg.startswith("model="):
            name = arg.split("=", 1)[1]
            return [module for prefix, module in HF_MODELING.items() if name.startswith(prefix)]
    return []


def context(extra: list[str] | None = None) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + list(extra or []))  # a module that fails to import is skipped
    return ctx


def start_early(args: list[str] | None = None) -> None:
    """Start the server now (it imports in the background) if this job will spawn ranks."""
    if will_spawn():
        context(extra_preload(args or []))
        multiprocessing.forkserver.ensure_running()
        atexit.register(stop)


def stop() -> None:
    """End the server with the job. Left to itself it would exit once the job's process is
    gone, through a full interpreter teardown of everything it preloaded (over a second),
    holding the job's stdout and stderr open all the while: a caller reading them (a
    pipe, ``tee``, CI, ``subprocess.run``) would wait that long for the job to end. The
    server holds no state worth a teardown; the ranks it forked have ended by now."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
