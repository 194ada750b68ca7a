"""The run directory and its locks: one live job per directory, attempts moved aside.

A job's run directory (``hydra.run.dir`` or a sweep point's directory) and its checkpoint
directory are each held by an exclusive lock on ``<dir>/.lock`` that names the holder's pid;
the operating system releases it when the process ends, however it ends. A second live job
there is refused at once, before it moves or writes anything. An earlier attempt's records
in a reused directory are moved to ``attempts/<n>/``: a new run deletes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import IO, Any

from omegaconf import OmegaConf

from sharded_exp.checkpoint.plan import CheckpointPlan, archive_later
from sharded_exp.checkpoint.storage import hold_checkpoint_dir, hold_directory, next_numbered, remove_unfinished_saves
from sharded_exp.errors import RunDirInUse, writing
from sharded_exp.job.result import TRAINED

log = logging.getLogger(__name__)


def hold_run_dir(output_dir: str) -> IO:
    """Hold ``output_dir`` for this job (an exclusive lock on ``<output_dir>/.lock``, which
    names our pid). A second live job there is refused at once with RunDirInUse."""
    return hold_directory(
        output_dir,
        lambda owner: RunDirInUse(
            f"run directory {output_dir} is in use by a running job (pid {owner}); wait for it to end "
            "or choose another hydra.run.dir"
        ),
    )


def hold_checkpoints(checkpoint: CheckpointPlan) -> IO:
    """Hold the checkpoint directory for this job, then tidy it: the temporary directories of
    saves that never finished are removed (no other job writes there now), and checkpoints
    the plan archives are moved aside when the first save comes."""
    lock = hold_checkpoint_dir(checkpoint.directory)
    for stale in remove_unfinished_saves(checkpoint.directory):
        log.warning("removed %s: the temporary directory of a save that never finished", stale)
    archive_later(checkpoint)
    return lock


def release_run_dir(*locks: IO | None) -> None:
    """Let the held directories go: each lock file is removed, then its lock released.
    None and locks already released are skipped."""
    for held in locks:
        if held is None or held.closed:
            continue
        with contextlib.suppress(OSError):
            os.remove(held.name)
        held.close()


def archive_previous_attempt(output_dir: str, extra: tuple[str, ...] = ()) -> str | None:
    """Move an earlier attempt's records (result.json, rank errors, ``extra``) in a reused
    output directory to ``attempts/<n>/``: a new run deletes and overwrites nothing.
    Checkpoints stay where they are (a resumed run reads them). Returns the attempt's
    directory, or None when there was nothing to move."""
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


def restore_attempt(output_dir: str, attempt: str | None) -> None:
    """Move the records :func:`archive_previous_attempt` moved to ``attempt`` back (a job
    refused after its ranks started, before they stepped: the directory as it was), and remove
    ``attempt`` and ``attempts/`` where they are left empty. A record of this attempt's by the
    same name (a rank that failed while it waited) is kept, and the earlier one left where it
    is; so is one that cannot be moved: nothing is overwritten or lost, and nothing raises."""
    if attempt is None or not os.path.isdir(attempt):
        return
    for name in os.listdir(attempt):
        if not os.path.lexists(os.path.join(output_dir, name)):
            with contextlib.suppress(OSError):
                os.rename(os.path.join(attempt, name), os.path.join(output_dir, name))
    for empty in (attempt, os.path.dirname(attempt)):
        with contextlib.suppress(OSError):
            os.rmdir(empty)


def write_job_files(output_dir: str, files: dict[str, Any]) -> None:
    """The composed config, Hydra's config and the overrides, as Hydra would write them
    (``<output_dir>/.hydra/<name>``)."""
    for name, content in files.items():
        os.makedirs(os.path.join(output_dir, ".hydra"), exist_ok=True)
        with writing(os.path.join(output_dir, ".hydra", name)):
            OmegaConf.save(content, os.path.join(output_dir, ".hydra", name))


def remove_trained(output_dir: str) -> None:
    """Remove rank 0's record of its training figures (``TRAINED``): the final result.json,
    written next, holds them."""
    with contextlib.suppress(OSError):
        os.remove(os.path.join(output_dir, TRAINED))
