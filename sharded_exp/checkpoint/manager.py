"""The training loop's side of checkpoints: load at the start, save after the steps that
are due, save at a stop, and finish an asynchronous save in flight.

Collective: every rank creates the :class:`CheckpointManager` (it makes a process group
of its own for dcp, so an asynchronous save never shares a group with training) and calls
each method.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.checkpoint.state import (
    gather_model_state,
    gather_optimizer_state,
    local_optimizer_state,
    named_param_groups,
    restore,
    rng_state,
)
from sharded_exp.checkpoint.storage import FORMAT, publish, removed_on_failure, save_file, step_name
from sharded_exp.errors import is_no_space, no_space
from sharded_exp.measure.tracker import host_peak

WriteHook = Callable[[int, int], None]
"""Called as ``hook(rank, step)`` in the middle of writing a checkpoint (after its first
file): the testing aid that kills a save (``SHARDED_EXP_FAULT=...,kind=exit_in_save``)."""


@dataclass
class _Pending:
    """A dcp save whose files a background thread is still writing."""

    future: Any
    tmp: str
    path: str
    small: dict[str, Any] | None
    meta: dict[str, Any] | None


@contextlib.contextmanager
def _dcp_failure(tmp: str):
    """A dcp save that fails leaves no temporary directory; a full disk says so in one line.
    DCP reports a rank's failure as a ``CheckpointException`` of every rank's exceptions (a
    full disk inside it: ``[Errno 28]``, or the zip writer's "unexpected pos")."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        full = (
            is_no_space(exc, os.path.join(tmp, "__0_0.distcp"))
            or "Errno 28" in str(exc)
            or "No space left on device" in str(exc)
        )
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise no_space(tmp) from None
        raise


def load(plan: CheckpointPlan, strategy, device: torch.device) -> dict[str, Any]:
    """Restore the planned checkpoint on every rank, right after the build (before the
    manager exists: no process group of its own is needed); ``step`` 0 and no changes when
    the plan starts fresh."""
    if plan.resume is None:
        return {"step": 0, "resume_changes": []}
    return restore(strategy, plan.resume, device)


@dataclass
class CheckpointManager:
    """When, where and how a job writes its checkpoints, and what they record about it."""

    plan: CheckpointPlan
    job: dict[str, Any]
    """strategy, precision, optimizer and model config, for meta.json."""
    during_write: WriteHook | None = None
    rss_growth_mib: float = 0.0
    """Host memory a save added at its peak on this rank, largest over the saves (MiB)."""
    saved_step: int | None = None
    """The step of the last checkpoint this run wrote."""
    _token: str = ""
    _group: Any = None
    _pending: _Pending | None = field(default=None, repr=False)

    @classmethod
    def create(cls, plan: CheckpointPlan, job: dict[str, Any], during_write: WriteHook | None = None):
        """Every rank: the manager of this job (collective when checkpoints are written)."""
        self = cls(plan, job, during_write)
        if plan.every:
            # Temporary directories unique to this job: two jobs never share (or remove) one.
            token = [f"{os.getpid()}-{time.time_ns()}"]
            dist.broadcast_object_list(token, src=0)
            self._token = token[0]
            if plan.format == "dcp":
                self._group = dist.new_group(backend="gloo")
        return self

    @property
    def every(self) -> int:
        return self.plan.every

    # ------------------------------------------------------------------ the loop's hooks
    def due(self, steps_done: int, steps: int) -> bool:
        """A checkpoint belongs after ``steps_done`` steps (periodic, or the last step)."""
        return bool(self.every) and (steps_done % self.every == 0 or steps_done == steps)

    def after_step(self, strategy, steps_done: int, steps: int, device: torch.device, position) -> str | None:
        """The checkpoint after ``steps_done`` steps if one is due; ``position()``: where a
        user's dataset stands. Returns its path on rank 0."""
        if not self.due(steps_done, steps):
            return None
        path = self.save(strategy, steps_done, device, position())
        self.saved_step = steps_done
        return path

    def on_stop(self, strategy, steps_done: int, device: torch.device, position: dict | None) -> str | None:
        """Preempted: the state at the stop is worth more than the last periodic checkpoint."""
        if not self.every or self.saved_step == steps_done:
            return None
        return self.save(strategy, steps_done, device, position)

    def finish(self) -> None:
        """Complete the dcp save in flight (every rank): wait for its files, then rank 0
        writes train.pt and meta.json and publishes the directory."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            with _dcp_failure(pending.tmp):
                pending.future.result()
        dist.barrier(group=self._group)  # every rank's files are written
        if dist.get_rank() == 0:
            with removed_on_failure(pending.tmp):
                self._hook(0, pending.meta["step"])
                save_file(pending.small, os.path.join(pending.tmp, "train.pt"))
                publish(pending.tmp, pending.path, pending.meta, self.plan.keep)
        dist.barrier(group=self._group)

    # ------------------------------------------------------------------------ saving
    def save(self, strategy, step: int, device: torch.device, data: dict | None = None) -> str | None:
        """Write the checkpoint after ``step`` completed steps. Returns its path on rank 0.

        ``data``: the position in a user's dataset (the loader's epoch and samples), kept in
        meta.json for the resume; None for the synthetic tasks, whose position is the step.

        An existing checkpoint of the same step (from an earlier attempt in the same
        directory) is kept, not overwritten.
        """
        self.finish()
        with host_peak(grown := {}):
            path = self._save(strategy, step, device, data)
        self.rss_growth_mib = max(self.rss_growth_mib, grown["mib"])
        return path

    def _hook(self, rank: int, step: int) -> None:
        if self.during_write is not None:
            self.during_write(rank, step)

    def _save(self, strategy, step: int, device: torch.device, data: dict | None) -> str | None:
        rank = dist.get_rank()
        path = os.path.join(self.plan.directory, step_name(step))
        exists = [os.path.exists(path)] if rank == 0 else [None]
        dist.broadcast_object_list(exists, src=0)
        if exists[0]:
            if rank == 0:
                # tqdm.write: on a line of its own, not glued to the progress bar's
                tqdm.write(f"checkpoint {path} exists already: kept, not overwritten", file=sys.stderr)
            return path if rank == 0 else None
        tmp = os.path.join(self.plan.directory, f".{step_name(step)}.tmp.{self._token}")
        rng: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(rng_state(device), rng, dst=0)
        small = {"scaler": strategy.scaler.state_dict(), "rng": rng, "param_groups": named_param_groups(strategy)}
        meta = self._meta(strategy, step)
        if data is not None:
            meta["data"] = data
        if self.plan.format == "dcp":
            self._save_dcp(strategy, tmp, path, small if rank == 0 else None, meta if rank == 0 else None)
        else:
            model, optim = gather_model_state(strategy), gather_optimizer_state(strategy)
            if rank == 0:
                self._write_consolidated(tmp, path, step, model, optim, small, meta)
            dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is on disk
        return path if rank == 0 else None

    def _meta(self, strategy, step: int) -> dict[str, Any]:
        shapes = {}
        for k, v in strategy.module.state_dict().items():
            shapes[k] = list(v.shape)  # a DTensor's shape is the full one
        return {
            "format": FORMAT,
            "checkpoint_format": self.plan.format,
            "step": step,
            "time": time.time(),
            **self.job,
            "world_size": dist.get_world_size(),
            "param_shapes": shapes,
            "torch": torch.__version__,
        }

    def _save_dcp(self, strategy, tmp, path, small, meta) -> None:
        import torch.distributed.checkpoint as dcp  # lazy: torch.distributed.checkpoint, which a job that saves and loads none never needs

        state = {"model": strategy.module.state_dict(), "optim": {"state": local_optimizer_state(strategy)}}
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        if self.plan.asynchronous:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            self._pending = _Pending(future, tmp, path, small, meta)
        else:
            with _dcp_failure(tmp):
                dcp.save(state, storage_writer=writer, process_group=self._group)
            self._pending = _Pending(None, tmp, path, small, meta)
            self.finish()

    def _write_consolidated(self, tmp, path, step, model, optim, small, meta) -> None:
        os.makedirs(tmp)
        with removed_on_failure(tmp):
            save_file(model, os.path.join(tmp, "model.pt"))
            self._hook(dist.get_rank(), step)
            save_file(optim, os.path.join(tmp, "optim.pt"))
            save_file(small, os.path.join(tmp, "train.pt"))
            publish(tmp, path, meta, self.plan.keep)
