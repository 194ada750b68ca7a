"""The probe's fake step of a model the user sharded with FSDP2 (``fully_shard``).

The user's model cannot be faked in place: its parameters are DTensor shards, its units carry
FSDP's state and hooks bound to the real process group, and FSDP2 refuses a second
``fully_shard``. So the fake step runs on a copy, made the way the user made theirs:

1. :func:`unsharded_copy`: the module tree again, each module of its own class (FSDP2's
   generated ``FSDP<Name>`` class undone), without FSDP's state and hooks, each parameter a
   fake tensor of the DTensor's global shape (the whole parameter, as the user built it) and
   each buffer a fake of its own; the user's other attributes and hooks are shared, not copied;
2. :func:`fake_mesh`: a process group of the fake backend over the same ranks as the user's
   unit's group, beside the real one (no collective, no message: the fake backend's
   collectives do nothing), as a device mesh;
3. ``fully_shard`` applied to the copy's units (the modules that carry FSDP state in the
   user's model), children first as a user applies them, with each unit's own
   ``reshard_after_forward``, mixed-precision and offload policy;

and the user's steps run on the copy, as :mod:`sharded_exp.probe.fake` runs them for DDP,
with the rules the project's own fake step of an FSDP2 run uses
(:mod:`sharded_exp.predict.fake_step`): DTensor's shape propagation in a fake mode of its own,
the chunks FSDP cuts made lazily, and, on a gloo group, the copy gloo's reduce-scatter holds.

Not faked (a null prediction and the reason): a unit on a mesh of more than one dimension
(HSDP, or FSDP beside tensor parallelism), parameters kept out of FSDP (``ignored_params``)
and a model that also carries another composable API's state (``replicate``, ``checkpoint``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed import distributed_c10d as c10d
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY  # private torch API: re-check on upgrades
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 -- registers the "fake" backend

from sharded_exp.predict.fake_step import (
    GlooReduceScatter,
    _lazy_fsdp_chunks,
    _mod_tracker_warning_quiet,
    _separate_propagation_mode,
)

FSDP_HOOKS_FROM = "torch.distributed.fsdp"
"""The package whose hooks on a unit are FSDP's own (dropped from the copy; the copy's
``fully_shard`` registers its own)."""


def is_fsdp2(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an FSDP2 unit (``fully_shard`` applied to it)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def units(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """The FSDP2 units of ``model`` by name, children before their parents (the order in
    which ``fully_shard`` must be applied: a parent takes only the parameters no unit below
    it has taken)."""
    return [(name, m) for name, m in reversed(list(model.named_modules())) if isinstance(m, FSDPModule)]


def sharded_unit(model: nn.Module) -> FSDPModule:
    """A unit of ``model`` that holds parameters (its mesh is the one they are sharded on)."""
    found = next((unit for _, unit in units(model) if _param_group(unit) is not None), None)
    if found is None:
        raise ValueError(f"no FSDP2 unit of {type(model).__name__} holds a parameter")
    return found


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s FSDP2 sharding cannot be copied here, or None."""
    for name, unit in units(model):
        group = _param_group(unit)
        if group is None:
            continue
        mesh = group.mesh_info.mesh
        if mesh.ndim != 1:
            return (
                f"the FSDP2 unit {name or '(root)'} is on a {mesh.ndim}-dimensional device mesh (HSDP or FSDP with "
                "tensor parallelism): its fake copy is not made here; only one-dimensional meshes are"
            )
    managed = {id(p) for _, unit in units(model) for p in _managed(unit)}
    loose = [n for n, p in model.named_parameters() if id(p) not in managed]
    if loose:
        return (
            f"{len(loose)} parameter(s) are kept out of FSDP2 ({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}): "
            "a fake copy of such a model is not made here"
        )
    others = [
        key for m in model.modules() for key in getattr(m, "__dict__", {}).get(REGISTRY_KEY, {}) if key != "fully_shard"
    ]
    if others:
        return f"the model carries torch's composable {sorted(set(others))} beside fully_shard: not faked here"
    return None


def _param_group(unit: FSDPModule):
    return unit._get_fsdp_state()._fsdp_param_group  # private torch API: None for a unit without parameters


def _managed(unit: FSDPModule) -> list[nn.Parameter]:
    group = _param_group(unit)
    return [fp.sharded_param for fp in group.fsdp_params] if group is not None else []


def _unsharded_class(cls: type) -> type:
    """The user's class under FSDP2's generated ``FSDP<Name>(FSDPModule, Name)``."""
    if not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__bases__ if base is not FSDPModule)


def _fsdps(hook: Any) -> bool:
    owner = getattr(hook, "__self__", None)  # a bound method of FSDP's state
    where = getattr(hook, "__module__", None) or type(owner).__module__
    return isinstance(where, str) and where.startswith(FSDP_HOOKS_FROM)


def _without_fsdp_hooks(state: dict) -> None:
    """The module's hook dicts in ``state`` copied without FSDP's hooks (and their entries in
    the companion dicts that say a hook takes kwargs or is always called)."""
    dropped: set = set()
    for key, value in state.items():
        if key.endswith("hooks") and isinstance(value, dict):
            dropped |= {hid for hid, hook in value.items() if callable(hook) and _fsdps(hook)}
    for key, value in list(state.items()):
        if "hooks" in key and isinstance(value, dict):
            state[key] = type(value)((hid, hook) for hid, hook in value.items() if hid not in dropped)
        elif "hooks" in key and isinstance(value, set):
            state[key] = {hid for hid in value if hid not in dropped}


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree without FSDP2, its parameters whole: call inside a
    fake mode (every parameter and buffer of the copy is a fake tensor; the real ones are only
    read for their shapes). Tied parameters and shared modules stay shared."""
    made: dict[int, Any] = {}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            whole = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)  # a DTensor's shape is its global one
            made[id(t)] = nn.Parameter(whole, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else whole
        return made[id(t)]

    def copy(module: nn.Module) -> nn.Module:
        if id(module) in made:
            return made[id(module)]
        cls = _unsharded_class(type(module))
        new = cls.__new__(cls)
        state = {k: v for k, v in module.__dict__.items() if k not in (STATE_KEY, REGISTRY_KEY)}
        _without_fsdp_hooks(state)
        state["_parameters"] = type(module._parameters)(
            (n, None if p is None else tensor(p)) for n, p in module._parameters.items()
        )
        state["_buffers"] = type(module._buffers)(
            (n, None if b is None else tensor(b)) for n, b in module._buffers.items()
        )
        new.__dict__.update(state)
        made[id(module)] = new
        new._modules = type(module._modules)((n, None if c is None else copy(c)) for n, c in module._modules.items())
        return new

    return copy(model)


@contextlib.contextmanager
def fake_mesh(unit: FSDPModule):
    """A one-dimensional device mesh over a process group of the fake backend with the same
    ranks as ``unit``'s group, made beside the real process groups and destroyed after. Every
    rank of the job makes it, in the same order, as it makes any group; the fake backend
    sends nothing. The count c10d names groups by is put back, so that the user's later groups
    get the names they would have had."""
    real = _param_group(unit).mesh_info.mesh
    count = c10d._world.group_count
    group = dist.new_group(dist.get_process_group_ranks(real.get_group()), backend="fake")
    try:
        yield DeviceMesh.from_group(group, real.device_type)
    finally:
        dist.destroy_process_group(group)
        c10d._world.group_count = count


def shard_like(copy: nn.Module, model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` on ``copy``'s modules that are units in ``model``, with each unit's own
    settings, on ``mesh``."""
    modules = dict(copy.named_modules(remove_duplicate=False))
    for name, unit in units(model):
        group = _param_group(unit)
        settings = {}
        if group is not None:
            settings = {
                "reshard_after_forward": group.post_forward_mesh_info is not None,
                "mp_policy": group.mp_policy,
                "offload_policy": group.offload_policy,
            }
        fully_shard(modules[name], mesh=mesh, **settings)


def gloo(model: nn.Module) -> bool:
    """Whether ``model``'s units communicate over gloo (whose reduce-scatter copies its input)."""
    return dist.get_backend(_param_group(sharded_unit(model)).mesh_info.mesh.get_group()) == "gloo"


def parameters_by_name(model: nn.Module, copy: nn.Module) -> dict[int, nn.Parameter]:
    """The copy's (sharded) parameter for each of ``model``'s, by its id (the optimizer's groups
    hold the user's)."""
    theirs = dict(copy.named_parameters(remove_duplicate=False))
    return {id(p): theirs[n] for n, p in model.named_parameters(remove_duplicate=False)}


def fake_steps(model: nn.Module, optimizer, steps: Callable):
    """``steps(copy, groups)`` (the probe's two tracked steps of the user's step, with a fresh
    optimizer of the user's over ``groups``: :func:`sharded_exp.probe.fake.predict_peak`) run
    on an unsharded fake copy of ``model`` sharded again as the user sharded it, on a fake
    process group of the same ranks (the module's docstring); returns what ``steps`` returns.
    ``groups``: the optimizer's parameter groups over the copy's parameters."""
    first = sharded_unit(model)  # any: the refusal checked that each is on a one-dimensional mesh
    copies = GlooReduceScatter() if gloo(model) else contextlib.nullcontext()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # FSDP's bookkeeping makes a few real tensors
    with (
        fake_mesh(first) as mesh,
        _mod_tracker_warning_quiet(),
        _separate_propagation_mode(),
        _lazy_fsdp_chunks(),
        copies,
        mode,
    ):
        copy = unsharded_copy(model)
        shard_like(copy, model, mesh)
        theirs = parameters_by_name(model, copy)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [theirs[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        return steps(copy, groups)
