"""The console scripts: ``sharded-exp``, ``sharded-exp-plan``, ``sharded-exp-report``.

Each is the same program as its ``python -m`` form. This module imports only the standard
library: ``sharded-exp`` starts the rank server before anything heavy is imported (as
``python -m sharded_exp`` does), and Hydra's questions (``--help``, ``--cfg job``,
``-sc query=bash``) start no ranks at all.
"""

from __future__ import annotations

import sys
import time

QUERIES = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
"""Hydra's own questions: they print and exit."""


def is_query(args: list[str]) -> bool:
    return any(a in QUERIES or a.startswith(("--cfg=", "--info=", "--shell-completion=")) for a in args)


def start_rank_server(args: list[str]) -> None:
    """Start the rank server now (it imports torch while this process imports too), unless
    the command only asks Hydra a question."""
    if not is_query(args):
        from sharded_exp.launch import forkserver

        forkserver.start_early(args)


def train() -> None:
    """``sharded-exp``: ``python -m sharded_exp``."""
    started = time.time()
    start_rank_server(sys.argv[1:])
    from sharded_exp import __main__ as job

    job.STARTED = started
    job.run()


def plan() -> int:
    """``sharded-exp-plan``: ``python -m sharded_exp.plan``."""
    from sharded_exp.plan.command import main

    return main()


def report() -> int:
    """``sharded-exp-report``: ``python -m sharded_exp.report``."""
    from sharded_exp.report import main

    return main()
