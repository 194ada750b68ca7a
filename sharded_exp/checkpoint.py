"""Checkpoints: one consolidated format that every strategy writes and reads.

A checkpoint is a directory ``<checkpoint_dir>/step_00000010/`` holding

- ``model.pt``: the full (unsharded) model state dict, keyed by parameter name;
- ``optim.pt``: the full optimizer state keyed by parameter name (``{"state": {name:
  {...}}, "param_groups": [{"params": [names], **hyperparameters}]}``), gathered from the
  shards of OSS / ZeRO-1 / ShardedDDP and from the DTensors of FSDP2;
- ``train.pt``: grad scaler state and every rank's RNG states;
- ``meta.json``: step, strategy, world size, precision, optimizer, model config and every
  parameter's shape (read by the parent to reject a wrong checkpoint before ranks start).

Being consolidated and keyed by name, a checkpoint written under one strategy and world
size loads under any other (the data position is the step: batches are a pure function
of step, micro-batch and rank). The price is that rank 0 holds the full state while
saving; torch.distributed.checkpoint's sharded format would avoid that for very large
FSDP models and is not used here.

Writes are atomic: rank 0 writes into ``.step_00000010.tmp/``, fsyncs, then renames it to
``step_00000010``. A directory named ``step_*`` is complete by construction; a kill at any
moment leaves at most a ``.tmp`` directory that readers ignore.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from sharded_exp.train import faults

FORMAT = 1
FILES = ("model.pt", "optim.pt", "train.pt", "meta.json")
_NAME = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the configured job."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.fullmatch(name)
        if m and os.path.isfile(os.path.join(directory, name, "meta.json")):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


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


def read_meta(path: str) -> dict[str, Any]:
    """meta.json of a checkpoint, after checking that every file is there and readable."""
    for name in FILES:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {meta_path} has format {meta.get('format')!r}; this version reads {FORMAT}")
    for name in ("model.pt", "optim.pt", "train.pt"):
        _load(os.path.join(path, name))  # memory-mapped: cheap, and catches truncation
    return meta


def _load(file: str) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 -- any failure to read is a corrupt file
        raise CheckpointError(f"checkpoint file {file} is corrupt or unreadable: {exc}") from None


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
        raise CheckpointError(
            f"checkpoint {where} is from a different model (model={meta['model'].get('name')}, "
            f"{len(saved)} tensors): {detail}"
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


# ----------------------------------------------------------------- full optimizer state
def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if isinstance(t, DTensor) else t  # collective for DTensors
    return t.detach().to("cpu", copy=True)


def gather_optimizer_state(strategy) -> dict[str, Any] | None:
    """The full optimizer state keyed by parameter name, on rank 0 (None elsewhere).

    Collective. Each rank reads the state of the parameters its local optimizers hold;
    for DTensors (FSDP2) that is a gather of every shard, for OSS-style sharding each rank
    contributes the parameters it owns.
    """
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    local: dict[str, dict[str, torch.Tensor]] = {}
    for opt in strategy.local_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                if p in opt.state:
                    local[names[id(p)]] = {k: _full(v) for k, v in opt.state[p].items()}
    if strategy.optimizer_state_sharded:
        parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        local = {k: v for part in parts for k, v in part.items()}
    elif dist.get_rank() != 0:
        return None
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in strategy.optimizer.param_groups
    ]
    return {"state": local, "param_groups": groups}


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) in the layout of ``param``: sharded if it is a DTensor."""
    if isinstance(param, DTensor) and value.dim() > 0:
        # Every rank has the full value: each keeps its own shard, no communication.
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def load_optimizer_state(strategy, saved: dict[str, Any]) -> None:
    """Install a full, name-keyed optimizer state into this rank's (possibly sharded) optimizer."""
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    groups = saved["param_groups"]
    if len(groups) != len(strategy.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(groups)} optimizer parameter groups, this optimizer {len(strategy.optimizer.param_groups)}"
        )
    group_of = {n: i for i, g in enumerate(groups) for n in g["params"]}
    hyper = lambda g: {k: v for k, v in g.items() if k != "params"}
    for group, saved_group in zip(strategy.optimizer.param_groups, groups):
        group.update(hyper(saved_group))  # OSS / ZeRO copy these into their local optimizer
    params = {n: p for n, p in strategy.module.named_parameters()}
    for opt in strategy.local_optimizers():
        state, param_groups, index = {}, [], 0
        for group in opt.param_groups:
            ids = []
            for p in group["params"]:
                name = names[id(p)]
                if name in saved["state"]:
                    state[index] = {k: _like(v, params[name]) for k, v in saved["state"][name].items()}
                ids.append(index)
                index += 1
            source = groups[group_of[names[id(group["params"][0])]]] if group["params"] else {}
            param_groups.append({**hyper(group), **hyper(source), "params": ids})
        opt.load_state_dict({"state": state, "param_groups": param_groups})


def load_model_state(strategy, saved: dict[str, torch.Tensor]) -> None:
    current = strategy.module.state_dict()
    strategy.module.load_state_dict({k: _like(v, current[k]) if k in current else v for k, v in saved.items()})


# ----------------------------------------------------------------------- save / load
def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, file: str) -> None:
    with open(file, "wb") as f:
        if file.endswith(".json"):
            f.write(json.dumps(obj, indent=2).encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Checkpointer:
    """When and where the loop writes checkpoints, and what they record about the job."""

    directory: str
    """trainer.checkpoint_dir (resolved by the parent)."""
    every: int
    """trainer.checkpoint_every: steps between checkpoints; 0 = none."""
    keep: int
    """trainer.keep_checkpoints: newest kept; 0 = all."""
    job: dict[str, Any]
    """strategy, precision, optimizer and model config, for meta.json."""

    @classmethod
    def from_config(cls, cfg) -> "Checkpointer":
        job = {
            "strategy": cfg.strategy.name,
            "precision": str(cfg.precision.name),
            "optimizer": cfg.optimizer.name,
            "model": dict(cfg.model),
        }
        t = cfg.trainer
        return cls(directory=t.checkpoint_dir, every=t.checkpoint_every, keep=t.keep_checkpoints, job=job)

    def due(self, steps_done: int, steps: int) -> bool:
        """A checkpoint belongs after ``steps_done`` steps (periodic, or the last step)."""
        return bool(self.every) and (steps_done % self.every == 0 or steps_done == steps)

    def save(self, strategy, step: int, device: torch.device) -> str | None:
        """Write the checkpoint after ``step`` completed steps; collective, rank 0 writes.

        Returns the checkpoint path on rank 0. An existing checkpoint of the same step (from
        an earlier attempt in the same directory) is kept, not overwritten.
        """
        model = strategy.full_state_dict()  # collective (FSDP gathers)
        optim = gather_optimizer_state(strategy)  # collective
        rng: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(_rng_state(device), rng, dst=0)
        path = None
        if dist.get_rank() == 0:
            path = os.path.join(self.directory, step_name(step))
            if os.path.exists(path):
                print(f"checkpoint {path} exists already: kept, not overwritten", flush=True)
            else:
                _write(path, strategy, self.job, step, model, optim, rng)
                _prune(self.directory, self.keep)
        dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is on disk
        return path


def _write(path, strategy, job, step, model, optim, rng) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, "." + os.path.basename(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a write that was killed
    os.makedirs(tmp)
    _save_file({k: v.detach().cpu() for k, v in model.items()}, os.path.join(tmp, "model.pt"))
    faults.in_save(dist.get_rank(), step)  # testing aid: a kill in the middle of a save
    _save_file(optim, os.path.join(tmp, "optim.pt"))
    _save_file({"scaler": strategy.scaler.state_dict(), "rng": rng}, os.path.join(tmp, "train.pt"))
    meta = {
        "format": FORMAT,
        "step": step,
        "time": time.time(),
        "strategy": job["strategy"],
        "world_size": dist.get_world_size(),
        "precision": job["precision"],
        "optimizer": job["optimizer"],
        "model": job["model"],
        "param_shapes": {k: list(v.shape) for k, v in model.items()},
        "torch": torch.__version__,
    }
    _save_file(meta, os.path.join(tmp, "meta.json"))  # last: its presence marks completeness
    _fsync_dir(tmp)
    os.rename(tmp, path)  # atomic: the checkpoint appears complete or not at all
    _fsync_dir(directory)


def _prune(directory: str, keep: int) -> None:
    if keep > 0:
        for _, old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load(strategy, path: str, device: torch.device) -> dict[str, Any]:
    """Restore model, optimizer, scaler and (at the same world size) RNG on every rank.

    Every rank reads the full files (memory-mapped) and keeps its own share.
    """
    meta = read_meta(path)
    load_model_state(strategy, _load(os.path.join(path, "model.pt")))
    load_optimizer_state(strategy, _load(os.path.join(path, "optim.pt")))
    train = _load(os.path.join(path, "train.pt"))
    if train["scaler"] and strategy.scaler.is_enabled():
        strategy.scaler.load_state_dict(train["scaler"])
    rank = dist.get_rank()
    if len(train["rng"]) == dist.get_world_size():
        torch.set_rng_state(train["rng"][rank]["cpu"])
        if device.type == "cuda" and "cuda" in train["rng"][rank]:
            torch.cuda.set_rng_state(train["rng"][rank]["cuda"], device)
    return meta
