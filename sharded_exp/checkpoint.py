"""Checkpoints in two formats that every strategy writes and reads, keyed by name.

    python -m sharded_exp.checkpoint export SRC DST    # a dcp checkpoint -> consolidated

A checkpoint is a directory ``<checkpoint_dir>/step_00000010/``. Its ``meta.json`` (step,
format, strategy, world size, precision, optimizer, model config, every parameter's
shape; read by the parent to reject a wrong checkpoint before any rank starts) and
``train.pt`` (grad scaler state, every rank's RNG state, the optimizer's parameter groups
by name) are the same in both formats. The tensors are either

- ``dcp`` (``trainer.checkpoint_format=dcp``, the default for every strategy that shards
  something): torch.distributed.checkpoint files. Each rank writes and reads only its own
  shards: the model state (FSDP2's DTensors, or one copy of replicated tensors), and the
  optimizer state of the parameters its local optimizers hold, under parameter names
  (``optim.state.<name>.<key>``). Loading reshards to any world size and strategy: a rank
  asks for the parameters it holds, in its own layout. With
  ``trainer.checkpoint_async=true`` the files are written by a background thread while
  training goes on; or
- ``consolidated`` (the default for ddp, and for exchange): ``model.pt`` and ``optim.pt``
  with the full state, written by rank 0. They are gathered one tensor at a time to rank
  0's CPU: no rank other than rank 0 ever holds more than one tensor of it.

The data position of a synthetic task is the step (batches are a pure function of step,
micro-batch and rank), so a checkpoint written under one strategy and world size resumes
under any other. A user's dataset is read as a stream (a DataLoader): meta.json's
``data`` holds its position (epoch, samples consumed in it), where a resumed run starts.

Writes are atomic: the files go into ``.step_00000010.tmp.<job>/`` (unique per job),
``meta.json`` last, fsynced, then rank 0 renames the directory to ``step_00000010``. A
directory named ``step_*`` is complete by construction; a kill at any moment leaves at
most a ``.tmp.*`` directory that readers ignore.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor, distribute_tensor
from tqdm import tqdm

from sharded_exp.errors import is_no_space, no_space
from sharded_exp.measure.tracker import host_peak
from sharded_exp.train import faults

FORMAT = 1
"""Version of meta.json's layout."""
FORMATS = ("dcp", "consolidated")
FILES = {
    "consolidated": ("model.pt", "optim.pt", "train.pt", "meta.json"),
    "dcp": (".metadata", "train.pt", "meta.json"),
}
META_KEYS = ("step", "strategy", "world_size", "optimizer", "model", "param_shapes")
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


def resume_step(path: str | None) -> int:
    """The step a run resumed from ``path`` (a resolved checkpoint, or None) starts at."""
    return int(read_meta(path)["step"]) if path else 0


def checkpoint_format(meta: dict[str, Any]) -> str:
    return meta.get("checkpoint_format", "consolidated")  # written before dcp existed


def read_meta(path: str) -> dict[str, Any]:
    """meta.json of a checkpoint, after checking that every file is there and readable
    (tensor files memory-mapped or, for dcp, checked against its metadata: no tensor is read)."""
    meta_path = os.path.join(path, "meta.json")
    for name in ("meta.json", "train.pt"):  # in both formats
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"checkpoint {meta_path} has format {found!r}; this version reads {FORMAT}")
    missing = [k for k in META_KEYS if k not in meta]
    fmt = checkpoint_format(meta)
    wrong = [k for k, ok in _meta_types(meta).items() if not ok]
    if missing or wrong or fmt not in FORMATS:
        raise CheckpointError(
            f"checkpoint file {meta_path} is corrupt: "
            + (f"keys missing: {', '.join(missing)}" if missing else f"wrong type or value: {', '.join(wrong)}")
        )
    for name in FILES[fmt]:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    tensor_files = ("model.pt", "optim.pt", "train.pt") if fmt == "consolidated" else ("train.pt",)
    for name in tensor_files:
        content = _load(os.path.join(path, name))  # memory-mapped: cheap, and catches truncation
        what = _holds(name, content, meta)
        if what:
            raise CheckpointError(f"checkpoint file {os.path.join(path, name)} is corrupt: {what}")
    if fmt == "dcp":
        _check_dcp_files(path, meta)
    return meta


def _meta_types(meta: dict[str, Any]) -> dict[str, bool]:
    """Each meta.json key that is there: is its value of the right kind?"""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    checks = {
        "step": lambda v: is_int(v) and v >= 0,
        "world_size": lambda v: is_int(v) and v >= 1,
        "strategy": lambda v: isinstance(v, str),
        "optimizer": lambda v: isinstance(v, str),
        "model": lambda v: isinstance(v, (dict, str)),
        "param_shapes": lambda v: (
            isinstance(v, dict)
            and all(isinstance(s, list) and all(is_int(d) and d >= 0 for d in s) for s in v.values())
        ),
    }
    return {k: check(meta[k]) for k, check in checks.items() if k in meta}


def _holds(name: str, content: Any, meta: dict[str, Any]) -> str | None:
    """Why a checkpoint file does not hold what its name says (e.g. two files swapped), or None."""
    if name == "model.pt":
        if not isinstance(content, dict) or not all(torch.is_tensor(v) for v in content.values()):
            return "it does not hold a model state dict (tensors by name)"
        if set(content) != set(meta["param_shapes"]):
            return "its tensors are not the ones meta.json names (files swapped or from another checkpoint?)"
    elif name == "optim.pt":
        if (
            not isinstance(content, dict)
            or not isinstance(content.get("state"), dict)
            or not isinstance(content.get("param_groups"), list)
        ):
            return "it does not hold an optimizer state (state and param_groups)"
    elif name == "train.pt":
        if not isinstance(content, dict) or not {"scaler", "rng", "param_groups"} <= set(content):
            return "it does not hold the training state (scaler, rng, param_groups)"
    return None


def _check_dcp_files(path: str, meta: dict[str, Any]) -> None:
    """The dcp metadata is readable, names the shapes meta.json names, and every byte range
    it points at exists on disk (catches truncated and missing shard files)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 -- any failure to read is a corrupt file
        raise CheckpointError(
            f"checkpoint file {os.path.join(path, '.metadata')} is corrupt or unreadable: {exc}"
        ) from None
    shapes = {
        k[len("model.") :]: list(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")
    }
    if shapes != {k: list(v) for k, v in meta["param_shapes"].items()}:
        raise CheckpointError(f"checkpoint {path}: .metadata and meta.json disagree on the model's shapes")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) < end:
            raise CheckpointError(f"checkpoint file {file} is missing or truncated (dcp metadata expects {end} bytes)")


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


# ------------------------------------------------------------------ state, by name
def _names(strategy) -> dict[int, str]:
    return {id(p): n for n, p in strategy.module.named_parameters()}


def local_optimizer_state(strategy) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state by parameter name: its own shard under OSS / ZeRO-1,
    DTensor shards under FSDP2, everything under DDP. No copy, no communication."""
    names = _names(strategy)
    local: dict[str, dict[str, torch.Tensor]] = {}
    for opt in strategy.local_optimizers():
        for group in opt.param_groups:
            for p in group["params"]:
                if p in opt.state:
                    local[names[id(p)]] = dict(opt.state[p])
    return local


def named_param_groups(strategy) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with parameter names instead of tensors."""
    names = _names(strategy)
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in strategy.optimizer.param_groups
    ]


def gather_model_state(strategy) -> dict[str, torch.Tensor] | None:
    """The full model state on rank 0's CPU (None elsewhere), one tensor at a time.

    Collective for DTensors: each is all-gathered alone and dropped at once on the other
    ranks, so no rank but rank 0 ever holds more than one full tensor.
    """
    rank0 = dist.get_rank() == 0
    out: dict[str, torch.Tensor] | None = {} if rank0 else None
    for name, value in strategy.module.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank0:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def gather_optimizer_state(strategy) -> dict[str, Any] | None:
    """The full optimizer state keyed by parameter name on rank 0's CPU (None elsewhere).

    Collective, one tensor at a time: DTensor state (FSDP2) is all-gathered tensor by
    tensor; a shard owned by another rank (OSS, ZeRO-1) is sent to rank 0 by its owner,
    tensor by tensor, from the device it lives on (no host copy on the owner).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = local_optimizer_state(strategy)
    out: dict[str, dict[str, torch.Tensor]] = {}
    if strategy.optimizer_state_sharded and world_size > 1:
        device = next(strategy.module.parameters()).device  # NCCL sends device tensors only
        held: list[Any] = [None] * world_size
        dist.all_gather_object(held, sorted(local))
        owner = {name: r for r, names in enumerate(held) for name in names}
        for name, _ in strategy.module.named_parameters():
            if name not in owner:
                continue
            if owner[name] == rank == 0:
                out[name] = {k: v.detach().to("cpu", copy=True) for k, v in local[name].items()}
            elif owner[name] == rank:
                state = local[name]
                dist.send_object_list([{k: (tuple(v.shape), v.dtype) for k, v in state.items()}], dst=0)
                for value in state.values():
                    dist.send(value.detach().to(device).contiguous(), dst=0)
            elif rank == 0:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=owner[name])
                out[name] = {}
                for key, (shape, dtype) in box[0].items():
                    buffer = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(buffer, src=owner[name])
                    out[name][key] = buffer.cpu()
    else:
        for name, state in local.items():
            for key, value in state.items():
                full = value.full_tensor() if isinstance(value, DTensor) else value  # collective for DTensors
                if rank == 0:
                    out.setdefault(name, {})[key] = full.detach().to("cpu", copy=True)
                del full
    return {"state": out, "param_groups": named_param_groups(strategy)} if rank == 0 else None


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) in the layout of ``param``: sharded if it is a DTensor."""
    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.dim() > 0:
        # Every rank has the full value: each keeps its own shard, no communication.
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def _plain(value: Any) -> Any:
    """A hyperparameter as plain data, for comparison (tuples as lists, 0-dim tensors as floats)."""
    if torch.is_tensor(value):
        return value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def hyperparameter_changes(current_groups: list[dict], saved_groups: list[dict]) -> list[dict[str, Any]]:
    """Every hyperparameter the config sets differently from the checkpoint, per group."""
    changes = []
    for i, (now, saved) in enumerate(zip(current_groups, saved_groups)):
        # the implementation (foreach, fused) follows the device, not the config: no change
        for key in sorted(set(now) & set(saved) - {"params", "foreach", "fused", "capturable", "differentiable"}):
            if _plain(now[key]) != _plain(saved[key]):
                changes.append({"group": i, "key": key, "checkpoint": _plain(saved[key]), "config": _plain(now[key])})
    return changes


def load_optimizer_state(strategy, saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Install a name-keyed optimizer state (full, or this rank's part of it) into this
    rank's (possibly sharded) optimizers.

    State (moments, step counts) comes from the checkpoint; hyperparameters (lr, betas,
    weight decay, momentum, ...) stay as configured. Returns the hyperparameters that
    differ from the checkpoint's (``resume_changes`` in result.json).
    """
    names = _names(strategy)
    groups = saved["param_groups"]
    if len(groups) != len(strategy.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(groups)} optimizer parameter groups, this optimizer {len(strategy.optimizer.param_groups)}"
        )
    changes = hyperparameter_changes(strategy.optimizer.param_groups, groups)
    hyper = lambda g: {k: v for k, v in g.items() if k != "params"}
    params = dict(strategy.module.named_parameters())
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
            param_groups.append({**hyper(group), "params": ids})  # this optimizer's own (configured) values
        opt.load_state_dict({"state": state, "param_groups": param_groups})
    return changes


def load_model_state(strategy, saved: dict[str, torch.Tensor]) -> None:
    current = strategy.module.state_dict()
    strategy.module.load_state_dict({k: _like(v, current[k]) if k in current else v for k, v in saved.items()})


# ----------------------------------------------------------------------- save
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
    try:
        with open(file, "wb") as f:
            if file.endswith(".json"):
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        if is_no_space(exc, file):
            raise no_space(file) from None
        raise


@contextlib.contextmanager
def _removed_on_failure(tmp: str):
    """A checkpoint's temporary directory goes if writing it fails (a full disk): the
    previous checkpoints stay as they were."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class _Pending:
    """A dcp save whose files a background thread is still writing."""

    future: Any
    tmp: str
    path: str
    small: dict[str, Any] | None
    meta: dict[str, Any] | None


@dataclass
class Checkpointer:
    """When, where and how the loop writes checkpoints, and what they record about the job.

    Collective: every rank creates it (it makes a process group of its own for dcp, so an
    asynchronous save never shares a group with training) and calls :meth:`save`.
    """

    directory: str
    """trainer.checkpoint_dir (resolved by the parent)."""
    every: int
    """trainer.checkpoint_every: steps between checkpoints; 0 = none."""
    keep: int
    """trainer.keep_checkpoints: newest kept; 0 = all."""
    job: dict[str, Any]
    """strategy, precision, optimizer and model config, for meta.json."""
    format: str = "consolidated"
    """dcp or consolidated (trainer.checkpoint_format, resolved by the parent)."""
    asynchronous: bool = False
    """trainer.checkpoint_async: dcp files written in the background."""
    rss_growth_mib: float = 0.0
    """Host memory a save added at its peak on this rank, largest over the saves (MiB)."""
    _token: str = ""
    _group: Any = None
    _pending: _Pending | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg) -> "Checkpointer":
        job = {
            "strategy": cfg.strategy.name,
            "precision": str(cfg.precision.name),
            "optimizer": cfg.optimizer.name,
            # plain data, nested parts included (a Hugging Face model's ``config``)
            "model": OmegaConf.to_container(cfg.model, resolve=True)
            if OmegaConf.is_config(cfg.model)
            else dict(cfg.model),
        }
        t = cfg.trainer
        fmt = str(getattr(t.checkpoint_format, "value", t.checkpoint_format))
        self = cls(t.checkpoint_dir, t.checkpoint_every, t.keep_checkpoints, job, fmt, bool(t.checkpoint_async))
        if self.every:
            # Temporary directories unique to this job: two jobs never share (or remove) one.
            token = [f"{os.getpid()}-{time.time_ns()}"]
            dist.broadcast_object_list(token, src=0)
            self._token = token[0]
            if self.format == "dcp":
                self._group = dist.new_group(backend="gloo")
        return self

    def due(self, steps_done: int, steps: int) -> bool:
        """A checkpoint belongs after ``steps_done`` steps (periodic, or the last step)."""
        return bool(self.every) and (steps_done % self.every == 0 or steps_done == steps)

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

    def _save(self, strategy, step: int, device: torch.device, data: dict | None) -> str | None:
        rank = dist.get_rank()
        path = os.path.join(self.directory, step_name(step))
        exists = [os.path.exists(path)] if rank == 0 else [None]
        dist.broadcast_object_list(exists, src=0)
        if exists[0]:
            if rank == 0:
                # tqdm.write: on a line of its own, not glued to the progress bar's
                tqdm.write(f"checkpoint {path} exists already: kept, not overwritten", file=sys.stderr)
            return path if rank == 0 else None
        tmp = os.path.join(self.directory, f".{step_name(step)}.tmp.{self._token}")
        rng: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(_rng_state(device), rng, dst=0)
        small = {"scaler": strategy.scaler.state_dict(), "rng": rng, "param_groups": named_param_groups(strategy)}
        meta = self._meta(strategy, step)
        if data is not None:
            meta["data"] = data
        if self.format == "dcp":
            self._save_dcp(strategy, step, tmp, path, small if rank == 0 else None, meta if rank == 0 else None)
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
            "checkpoint_format": self.format,
            "step": step,
            "time": time.time(),
            **self.job,
            "world_size": dist.get_world_size(),
            "param_shapes": shapes,
            "torch": torch.__version__,
        }

    def _save_dcp(self, strategy, step, tmp, path, small, meta) -> None:
        import torch.distributed.checkpoint as dcp

        state = {"model": strategy.module.state_dict(), "optim": {"state": local_optimizer_state(strategy)}}
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        if self.asynchronous:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            self._pending = _Pending(future, tmp, path, small, meta)
        else:
            try:
                dcp.save(state, storage_writer=writer, process_group=self._group)
            except Exception as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if is_no_space(exc, os.path.join(tmp, "__0_0.distcp")):
                    raise no_space(tmp) from None
                raise
            self._pending = _Pending(None, tmp, path, small, meta)
            self.finish()

    def finish(self) -> None:
        """Complete the dcp save in flight (every rank): wait for its files, then rank 0
        writes train.pt and meta.json and publishes the directory."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        dist.barrier(group=self._group)  # every rank's files are written
        if dist.get_rank() == 0:
            with _removed_on_failure(pending.tmp):
                faults.in_save(0, pending.meta["step"])  # testing aid: a kill in the middle of a save
                _save_file(pending.small, os.path.join(pending.tmp, "train.pt"))
                self._publish(pending.tmp, pending.path, pending.meta)
        dist.barrier(group=self._group)

    def _write_consolidated(self, tmp, path, step, model, optim, small, meta) -> None:
        os.makedirs(tmp)
        with _removed_on_failure(tmp):
            _save_file(model, os.path.join(tmp, "model.pt"))
            faults.in_save(dist.get_rank(), step)  # testing aid: a kill in the middle of a save
            _save_file(optim, os.path.join(tmp, "optim.pt"))
            _save_file(small, os.path.join(tmp, "train.pt"))
            self._publish(tmp, path, meta)

    def _publish(self, tmp: str, path: str, meta: dict[str, Any]) -> None:
        """meta.json last (its presence marks completeness), fsync, then the atomic rename."""
        _save_file(meta, os.path.join(tmp, "meta.json"))
        _fsync_dir(tmp)
        os.rename(tmp, path)  # atomic: the checkpoint appears complete or not at all
        _fsync_dir(self.directory)
        if self.keep > 0:
            for _, old in complete_checkpoints(self.directory)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------- load
def load(strategy, path: str, device: torch.device) -> dict[str, Any]:
    """Restore model, optimizer, scaler and (at the same world size) RNG on every rank;
    returns meta.json plus ``resume_changes`` (hyperparameters configured differently).

    consolidated: every rank maps the full files and keeps its own share. dcp: every rank
    reads only the shards it holds, in its own layout (any world size, any strategy).
    """
    meta = read_meta(path)
    train = _load(os.path.join(path, "train.pt"))
    if checkpoint_format(meta) == "dcp":
        changes = _load_dcp(strategy, path, train["param_groups"])
    else:
        load_model_state(strategy, _load(os.path.join(path, "model.pt")))
        changes = load_optimizer_state(strategy, _load(os.path.join(path, "optim.pt")))
    if train["scaler"] and strategy.scaler.is_enabled():
        strategy.scaler.load_state_dict(train["scaler"])
    rank = dist.get_rank()
    if len(train["rng"]) == dist.get_world_size():
        torch.set_rng_state(train["rng"][rank]["cpu"])
        if device.type == "cuda" and "cuda" in train["rng"][rank]:
            torch.cuda.set_rng_state(train["rng"][rank]["cuda"], device)
    return {**meta, "resume_changes": changes}


def _load_dcp(strategy, path: str, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    model = strategy.module.state_dict()
    # Optimizer state this rank will hold, allocated in its own layout (a DTensor shard
    # under FSDP2) from the checkpoint's metadata: dcp fills in just those bytes.
    entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = dict(strategy.module.named_parameters())
    held = {
        _names(strategy)[id(p)] for opt in strategy.local_optimizers() for g in opt.param_groups for p in g["params"]
    }
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in entries.items():
        if not key.startswith("optim.state."):
            continue
        name, _, sub = key[len("optim.state.") :].rpartition(".")
        if name not in held:
            continue
        param, dtype = params[name], entry.properties.dtype
        if tuple(entry.size) == tuple(param.shape):
            optim.setdefault(name, {})[sub] = torch.zeros_like(param, dtype=dtype)
        else:  # e.g. Adam's 0-dim step
            optim.setdefault(name, {})[sub] = torch.zeros(entry.size, dtype=dtype)
    dcp.load({"model": model, "optim": {"state": optim}}, checkpoint_id=path)
    strategy.module.load_state_dict(model)
    return load_optimizer_state(strategy, {"state": optim, "param_groups": param_groups})


# ----------------------------------------------------------------------- export
def export(src: str, dst: str) -> None:
    """Convert a dcp checkpoint directory into a consolidated one (one process, no ranks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = read_meta(src)
    if checkpoint_format(meta) != "dcp":
        raise CheckpointError(f"checkpoint {src} is {checkpoint_format(meta)} already; nothing to export")
    if os.path.exists(dst):
        raise CheckpointError(f"export destination {dst} exists; choose a new directory")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp.", dir=parent)
    flat = os.path.join(tmp, "all.pt")
    dcp_to_torch_save(src, flat)
    state = torch.load(flat, weights_only=False)
    os.remove(flat)
    train = _load(os.path.join(src, "train.pt"))
    _save_file({k: v.contiguous() for k, v in state["model"].items()}, os.path.join(tmp, "model.pt"))
    optim = {"state": state.get("optim", {}).get("state", {}), "param_groups": train["param_groups"]}
    _save_file(optim, os.path.join(tmp, "optim.pt"))
    shutil.copyfile(os.path.join(src, "train.pt"), os.path.join(tmp, "train.pt"))
    _save_file(
        {**meta, "checkpoint_format": "consolidated", "exported_from": os.path.abspath(src)},
        os.path.join(tmp, "meta.json"),
    )
    _fsync_dir(tmp)
    os.rename(tmp, dst)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "export":
        print(
            "usage: python -m sharded_exp.checkpoint export SRC DST   (a dcp checkpoint -> consolidated)",
            file=sys.stderr,
        )
        return 2
    try:
        export(argv[1], argv[2])
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the destination's filesystem: read-only, full, not ours
        where = exc.filename or argv[2]
        print(
            f"error: cannot export to {argv[2]}: {exc.strerror or exc} ({where}); nothing was written", file=sys.stderr
        )
        return 1
    print(f"exported {argv[1]} -> {argv[2]} (consolidated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
