"""A checkpoint's state by parameter name: gathered from, and restored into, any strategy's
layout (every rank calls these; they are collectives where a state is sharded)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from sharded_exp.checkpoint.storage import CheckpointError, checkpoint_format, load_file, read_meta


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
    """The full optimizer state keyed by parameter name on rank 0's CPU (None elsewhere):
    the strategy gathers its own state (``Strategy.gather_optimizer_state``), one tensor at
    a time; the parameter groups are named here."""
    state = strategy.gather_optimizer_state(local_optimizer_state(strategy), dict(strategy.module.named_parameters()))
    return {"state": state, "param_groups": named_param_groups(strategy)} if dist.get_rank() == 0 else None


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


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(strategy, path: str, device: torch.device) -> dict[str, Any]:
    """Restore model, optimizer, scaler and (at the same world size) RNG on every rank;
    returns meta.json plus ``resume_changes`` (hyperparameters configured differently).

    consolidated: every rank maps the full files and keeps its own share. dcp: every rank
    reads only the shards it holds, in its own layout (any world size, any strategy).
    """
    meta = read_meta(path)
    train = load_file(os.path.join(path, "train.pt"))
    if checkpoint_format(meta) == "dcp":
        changes = _load_dcp(strategy, path, train["param_groups"])
    else:
        load_model_state(strategy, load_file(os.path.join(path, "model.pt")))
        changes = load_optimizer_state(strategy, load_file(os.path.join(path, "optim.pt")))
    if train["scaler"] and strategy.scaler.is_enabled():
        strategy.scaler.load_state_dict(train["scaler"])
    rank = dist.get_rank()
    if len(train["rng"]) == dist.get_world_size():
        torch.set_rng_state(train["rng"][rank]["cpu"])
        if device.type == "cuda" and "cuda" in train["rng"][rank]:
            torch.cuda.set_rng_state(train["rng"][rank]["cuda"], device)
    return {**meta, "resume_changes": changes}


def _load_dcp(strategy, path: str, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed.checkpoint, which a job that saves and loads none never needs

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
