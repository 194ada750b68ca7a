"""Hydra's questions (``--help``, ``--cfg job``, ``-sc install=bash``): recognised from the
command line alone, with the standard library, before anything heavy is imported.

A question prints and exits: it starts no ranks, so the rank server is started early only
for a command that is not one (:func:`start_rank_server`).
"""

from __future__ import annotations

QUERIES = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
"""Hydra's own questions: they print and exit."""


def is_query(args: list[str]) -> bool:
    return any(a in QUERIES or a.startswith(("--cfg=", "--info=", "--shell-completion=")) for a in args)


def start_rank_server(args: list[str]) -> None:
    """Start the rank server now (it imports torch while this process imports too), unless
    the command only asks Hydra a question."""
    if not is_query(args):
        from sharded_exp.launch import forkserver  # lazy: multiprocessing, not for Hydra's questions

        forkserver.start_early(args)
