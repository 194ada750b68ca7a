"""Before any rank starts: which checkpoint a job resumes, and what it refuses or archives.

:func:`plan_checkpoints` runs in the parent's pre-flight. It decides the directory, the
format (``auto``: the strategy's ``default_checkpoint_format``), the checkpoint to resume
(``trainer.resume``: a path, ``auto`` for the newest, or none), and refuses a checkpoint
that cannot start this job, or later checkpoints of another trajectory in the directory
(``trainer.existing_checkpoints=refuse``; ``archive`` moves them, :func:`archive_later`).
The result, a :class:`CheckpointPlan`, travels to the ranks in the job spec.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from sharded_exp.checkpoint.storage import CheckpointError, complete_checkpoints, next_numbered, read_meta
from sharded_exp.config import TrainerConfig
from sharded_exp.errors import ConfigError, NothingToDo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPlan:
    """What the parent decided about checkpoints; the ranks take it as given."""

    directory: str
    """trainer.checkpoint_dir, absolute (default: ``<run dir>/checkpoints``)."""
    format: str
    """dcp or consolidated (trainer.checkpoint_format, ``auto`` resolved)."""
    every: int
    """trainer.checkpoint_every: steps between checkpoints; 0 = none."""
    keep: int
    """trainer.keep_checkpoints: newest kept; 0 = all."""
    asynchronous: bool
    """trainer.checkpoint_async: dcp files written in the background."""
    existing: str
    """trainer.existing_checkpoints: refuse or archive later checkpoints of another trajectory."""
    resume: str | None
    """The checkpoint to resume (a complete, compatible one), or None for a fresh start."""
    start_step: int
    """The step the job starts at (the checkpoint's, or 0)."""

    def config_values(self) -> dict[str, Any]:
        """The trainer settings as decided: what result.json's ``config`` shows."""
        return {"checkpoint_dir": self.directory, "checkpoint_format": self.format, "resume": self.resume}


def plan_checkpoints(
    trainer_cfg: TrainerConfig, default_format: str, output_dir: str, state_shapes: dict, optimizer: str
) -> CheckpointPlan:
    """The checkpoint plan of a job, checked: the checkpoint to resume is complete, readable
    and fits this model, optimizer and ``trainer.steps``. Raises ConfigError (NothingToDo
    for ``resume=auto`` past the last step), naming the setting, before anything is written."""
    t = trainer_cfg
    fmt = _name(t.checkpoint_format)
    fmt = default_format if fmt == "auto" else fmt
    if t.checkpoint_async and fmt != "dcp":
        raise ConfigError(f"trainer.checkpoint_async=true needs trainer.checkpoint_format=dcp (it is {fmt})")
    directory = os.path.abspath(t.checkpoint_dir or os.path.join(output_dir, "checkpoints"))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(
            f"trainer.checkpoint_dir={directory} is a file, not a directory; choose another trainer.checkpoint_dir"
        )
    existing = _name(t.existing_checkpoints)
    try:
        resume = resolve_resume(t.resume, directory)
        start = 0
        if resume is not None:
            meta = read_meta(resume)
            start = meta["step"]
        if t.checkpoint_every and existing == "refuse":
            check_no_later(directory, start)
        if resume is not None:
            if t.resume == "auto" and start >= t.steps:
                raise NothingToDo(
                    f"trainer.resume=auto: the newest checkpoint, {resume}, is at step {start} of "
                    f"trainer.steps={t.steps}: this job is done, nothing to do"
                )
            check_compatible(resume, meta, state_shapes, optimizer, t.steps)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    return CheckpointPlan(
        directory, fmt, t.checkpoint_every, t.keep_checkpoints, bool(t.checkpoint_async), existing, resume, start
    )


def _name(option) -> str:
    return str(option)


def check_no_later(directory: str, start: int) -> None:
    """A run that writes checkpoints must not meet later ones from another trajectory in
    its directory: they would be kept in place of its own, and resume=auto would continue
    them (trainer.existing_checkpoints=refuse)."""
    later = [path for step, path in complete_checkpoints(directory) if step > start]
    if later:
        names = ", ".join(os.path.basename(p) for p in later[:4]) + (", ..." if len(later) > 4 else "")
        raise ConfigError(
            f"trainer.checkpoint_dir={directory} already holds {names}, later than step {start} where this "
            "run starts: another trajectory, which this run would mix with its own. Choose another "
            "trainer.checkpoint_dir, resume from the newest (trainer.resume=auto), or set "
            "trainer.existing_checkpoints=archive to move them to archived/<n>/ first"
        )


def archive_later(plan: CheckpointPlan) -> str | None:
    """trainer.existing_checkpoints=archive: checkpoints later than the plan's start (another
    trajectory's) move to ``<directory>/archived/<n>/``, where resume=auto does not look."""
    if not plan.every or plan.existing != "archive":
        return None
    later = [path for step, path in complete_checkpoints(plan.directory) if step > plan.start_step]
    if not later:
        return None
    target = next_numbered(os.path.join(plan.directory, "archived"))
    for path in later:
        os.rename(path, os.path.join(target, os.path.basename(path)))
    log.warning("moved %d later checkpoint(s) of another trajectory to %s", len(later), target)
    return target


def resolve_resume(resume: str | None, directory: str) -> str | None:
    """The checkpoint to start from: None (fresh), the newest in ``directory`` for
    ``auto`` (None if there is none yet), or the given path, which must exist."""
    if resume in (None, "", "none", "null"):
        return None
    if resume == "auto":
        found = complete_checkpoints(directory)
        return found[-1][1] if found else None
    path = os.path.abspath(resume)
    if not os.path.isdir(path):
        raise CheckpointError(f"trainer.resume={resume}: no such checkpoint directory ({path})")
    return path


def resume_step(path: str | None) -> int:
    """The step a run resumed from ``path`` (a resolved checkpoint, or None) starts at."""
    return int(read_meta(path)["step"]) if path else 0


def check_compatible(path: str, meta: dict[str, Any], shapes: dict[str, tuple], optimizer: str, steps: int) -> None:
    """Raise CheckpointError, naming the file, if the checkpoint cannot start this job."""
    where = os.path.join(path, "meta.json")
    saved = {k: tuple(v) for k, v in meta["param_shapes"].items()}
    if saved != shapes:
        missing = sorted(set(shapes) - set(saved))
        extra = sorted(set(saved) - set(shapes))
        differ = [k for k in shapes if k in saved and saved[k] != shapes[k]]
        detail = (
            f"parameter {differ[0]} is {list(saved[differ[0]])} there, {list(shapes[differ[0]])} here"
            if differ
            else f"missing there: {missing[:3]}, not in this model: {extra[:3]}"
        )
        model_name = meta["model"].get("name") if isinstance(meta["model"], dict) else meta["model"]
        raise CheckpointError(
            f"checkpoint {where} is from a different model (model={model_name}, {len(saved)} tensors): {detail}"
        )
    if meta["optimizer"] != optimizer:
        raise CheckpointError(
            f"checkpoint {where} holds {meta['optimizer']} state; optimizer={optimizer} cannot load it "
            f"(use optimizer={meta['optimizer']})"
        )
    if meta["step"] >= steps:
        raise CheckpointError(
            f"checkpoint {where} is at step {meta['step']}, not before trainer.steps={steps}: nothing to train "
            "(raise trainer.steps)"
        )
