"""Python logging for the parent and every rank, through Hydra's job logging.

Hydra configures the parent's logging from ``conf/hydra/job_logging/sharded_exp.yaml``: the
console (stderr) and ``<run dir>/sharded_exp.log`` (a sweep point's own directory in a
sweep), every line naming who wrote it (``parent``, ``rank 0``, ...). Spawned ranks are
fresh processes that Hydra never configured: :func:`setup_rank` gives each the same two
handlers, appending to the parent's file, at the parent's level. ``hydra.verbose=true``
(or ``hydra.verbose=sharded_exp``) makes it DEBUG, ``hydra.job_logging.root.level=WARNING``
quiet. What a run prints as its answer (the end-of-run table, a sweep's headline) stays
on stdout, outside logging.
"""

from __future__ import annotations

import logging
import os
import sys

FILE_FORMAT = "[%(asctime)s][%(who)s][%(name)s][%(levelname)s] %(message)s"
CONSOLE_FORMAT = "[%(who)s] %(message)s"
LOG_NAME = "sharded_exp.log"

_who: str | None = None


def _default_who() -> str:
    # A rank an external launcher started (torchrun, SLURM) is configured by Hydra as a parent is.
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else "parent"


class Who(logging.Filter):
    """Adds ``who`` to every record: the parent or ``rank N``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.who = _who or _default_who()
        return True


def job_log_file() -> str | None:
    """The file Hydra's job logging writes (None outside a Hydra job, or with another logging config)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and os.path.basename(handler.baseFilename) == LOG_NAME:
            return handler.baseFilename
    return None


def level() -> int:
    """The level our package logs at in this process (hydra.verbose may have lowered it)."""
    return logging.getLogger("sharded_exp").getEffectiveLevel()


def setup_rank(rank: int, log_file: str | None, log_level: int) -> None:
    """A spawned rank: the parent's console and file handlers, ``rank N`` in every line."""
    setup_forked(f"rank {rank}", log_file, log_level)


def setup_forked(who: str, log_file: str | None, log_level: int) -> None:
    """A process forked from the rank server (a rank, or the parent's pre-flight check run
    there): the parent's console and file handlers, ``who`` in every line."""
    global _who
    _who = who
    root = logging.getLogger()
    for handler in list(root.handlers):  # a forked server's, or none
        root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        file = logging.FileHandler(log_file, mode="a", delay=True)  # appends: one line, one write
        file.setFormatter(logging.Formatter(FILE_FORMAT))
        handlers.append(file)
    for handler in handlers:
        handler.addFilter(Who())
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("sharded_exp").setLevel(log_level)
