"""Errors every part may raise, in a module that imports nothing of ours.

Builders (strategies, models, tasks) raise :class:`ConfigError` for values they cannot
build; the parent's pre-flight (:mod:`sharded_exp.launch.preflight`) turns it into
``error: ...`` and exit code 2 before any rank steps (before any starts, but for what only
the peak's fake step finds where the ranks start while it runs:
:func:`sharded_exp.launch.preflight.check_in_two`).
"""

from __future__ import annotations

import difflib
import errno
import importlib.util
import os
import shutil

OOM_SIGNS = (
    "OutOfMemoryError",
    "can't allocate memory",
    "not enough memory",
    "CUDA error: out of memory",
    "Cuda failure 'out of memory'",
    "CUBLAS_STATUS_ALLOC_FAILED",
)
"""What an allocation failure says: torch's CUDA OOM, the CPU allocator's (DefaultCPUAllocator),
and those that are not torch.OutOfMemoryError: a CUDA call's own (``CUDA error: out of
memory``), NCCL's (``Cuda failure 'out of memory'``) and cuBLAS's handle or workspace."""


def is_oom(exc: BaseException) -> bool:
    """Is ``exc`` an allocation failure (see :data:`OOM_SIGNS`)?"""
    text = f"{type(exc).__name__}: {exc}"
    return any(sign in text for sign in OOM_SIGNS)


class ConfigError(ValueError):
    """A config value that composes but cannot run; the message names value and choices."""


def missing_packages(packages) -> list[str]:
    """The import names in ``packages`` that cannot be imported here (without importing them)."""
    missing = []
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that fails, or a module set to None
            found = False
        if not found:
            missing.append(name)
    return missing


class NothingToDo(ConfigError):
    """``trainer.resume=auto`` found a checkpoint at (or past) ``trainer.steps``: the job is
    done (a requeued job that finished before it was requeued). Not an error: exit 0."""


class WontFit(ConfigError):
    """Predicted not to fit the machine's memory, before anything starts: in a sweep, a
    point with status "oom" (a result: this point does not fit), not a failure."""


class RunDirInUse(ConfigError):
    """Another live job holds this run directory (its pid is named)."""


def no_space(file: str) -> OSError:
    """The error a full filesystem gives, naming the file being written."""
    return OSError(errno.ENOSPC, f"no space left on device while writing {file}")


def is_no_space(exc: BaseException, file: str) -> bool:
    """Did writing ``file`` fail because its filesystem is full? (torch.save reports a full
    disk as a zip writer error, "unexpected pos ...", so the free space is asked too.)"""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(file))).free < 2**20
    except OSError:
        return False


class writing:  # noqa: N801 -- used as ``with writing(path):``
    """Name the file when writing it fails for lack of space: ``no space left on device
    while writing <file>`` instead of a bare ENOSPC (or torch's "unexpected pos")."""

    def __init__(self, file: str):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, (OSError, RuntimeError)) and is_no_space(exc, self.file):
            raise no_space(self.file) from None
        return False


def closest(name: str, candidates) -> str | None:
    """The candidate ``name`` most likely meant (difflib, as Python's own "did you mean"), or None."""
    found = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None
