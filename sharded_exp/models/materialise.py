"""How a model comes into being on every rank: built on the meta device, wrapped by a
strategy, then initialised unit by unit, so that no rank ever holds the whole model unasked
and every strategy starts from the same weights. :func:`materialise_model` owns the order
(skeleton, the caller's preparation, allocation, the strategy's wrapping, initialisation);
:func:`sharded_exp.train.build.build_run` assembles a run around it.

How a model is made (:func:`build_rule`):

- ``units``: our models and Hugging Face classes are built with their parameters on the
  meta device (no memory; buffers are made as the constructor makes them), wrapped, and
  then initialised unit by unit (:func:`sharded_exp.models.units`, the root's own modules
  last), each unit from a seed of its own: ``reset_parameters`` for torch's modules, the
  model's ``_init_weights`` for Hugging Face's. Under a strategy that shards parameters
  (FSDP) a unit is initialised whole in host memory, each rank keeps its shard, and the
  unit is freed: no rank ever holds more than its shards plus one unit. Every strategy
  initialises the same way, so every strategy starts from the same weights.
- ``whole``: a user's ``_target_`` factory, or a model registered by a plugin
  (``SHARDED_EXP_PLUGINS``), initialises its model in its own constructor, which only a whole
  build reproduces (a constructor may zero a head, set a bias, compute a buffer from a weight,
  or leave a parameter its ``reset_parameters`` does not touch): it is built whole on every
  rank, then wrapped. So is any model whose skeleton shows the same: a parameter no
  ``reset_parameters`` covers, or a buffer computed from a parameter (a meta buffer).

The ``units`` rule is checked as it runs, and refuses, naming the parameter, rather than
change initial weights silently: every parameter a unit's initialisation should write is
filled with NaN first and must hold no NaN after it (an initialisation that skipped it), and
no unit's initialisation may write another unit's parameters (a root ``reset_parameters``
that re-initialises its blocks would do so on FSDP's shards, and differ from DDP).
- ``pretrained``: ``model.pretrained``'s weights; under FSDP rank 0 alone loads them and
  every rank keeps its shard (:func:`load_sharded_from_rank0`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import get_class
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor

from sharded_exp.config_file import is_target_model
from sharded_exp.errors import ConfigError, missing_packages
from sharded_exp.models import MODELS, build_model, units


def build_rule(model_cfg, weights: bool = True) -> str:
    """``units``, ``whole`` or ``pretrained``: how :func:`build_run` makes this model."""
    if weights and model_cfg.get("pretrained"):
        return "pretrained"
    if is_target_model(model_cfg):
        return "units" if _is_hf_class(model_cfg) else "whole"
    return "units" if _is_builtin_model(model_cfg) else "whole"


def _is_builtin_model(model_cfg) -> bool:
    """True for the models of :mod:`sharded_exp.models` (their initialisation is their
    modules' ``reset_parameters``, by construction); False for a model a plugin registered,
    whose constructor only a whole build is known to reproduce."""
    builder = MODELS.builder(str(model_cfg.name))
    return getattr(builder, "__module__", "").startswith("sharded_exp.models.")


def _is_hf_class(model_cfg) -> bool:
    """True when ``model._target_`` names a Hugging Face ``PreTrainedModel`` class (whose
    initialisation is its ``_init_weights``, module by module)."""
    target = str(model_cfg.get("_target_") or "")
    if not target.startswith("transformers.") or missing_packages(["transformers"]):
        return False
    from transformers import PreTrainedModel  # lazy: transformers is optional ([hf])

    try:
        cls = get_class(target)
    except Exception:  # noqa: BLE001 -- not a class (a factory): built whole
        return False
    return isinstance(cls, type) and issubclass(cls, PreTrainedModel)


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside goes to the meta device (no memory); buffers stay
    where the constructor made them, with their values (a rotary table, a causal mask).
    The weights a constructor would draw are drawn later, unit by unit."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _post_order(module: nn.Module, skip: set[int]):
    """Submodules children first (as Hugging Face's ``initialize_weights`` walks them, so a
    parent's rule, GPT-2's scaled projections, comes last), leaving out those in ``skip``."""
    for child in module.children():
        if id(child) not in skip:
            yield from _post_order(child, skip)
    yield module


def init_groups(module: nn.Module) -> list[list[nn.Module]]:
    """The modules each unit initialises, in order: every unit's own, then the root's (the
    modules outside every unit). Each group is drawn from a seed of its own."""
    found = units(module)
    groups = [list(_post_order(u, set())) for u in found]
    groups.append(list(_post_order(module, {id(u) for u in found})))
    return groups


def _hf_rule(root: nn.Module) -> bool:
    """True when ``root`` initialises module by module through its ``_init_weights`` (a
    Hugging Face model: its own rule for every module, including those torch cannot reset)."""
    return callable(getattr(root, "_init_weights", None)) and hasattr(root, "config")


def _init_module(root: nn.Module, mod: nn.Module) -> None:
    """``mod``'s own parameters and buffers as its model initialises them."""
    if _hf_rule(root):
        root._init_weights(mod)
        return
    reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
    if reset is not None and (next(mod.parameters(recurse=False), None) is not None or mod._buffers):
        reset()


def unit_seed(seed: int, index: int) -> int:
    """The seed of init group ``index``: the same on every rank and under every strategy,
    and apart from ``trainer.seed``'s own stream (which the data task draws from: a teacher
    network drawn with the model's first unit's numbers would be that unit)."""
    return ((int(seed) + 1) * 0x9E3779B97F4A7C15 + index) % 2**63


def check_initialisable(module: nn.Module) -> None:
    """Raise ConfigError naming a parameter no module's initialisation covers (its owner
    has no ``reset_parameters`` and the model no ``_init_weights``): built on the meta
    device, it would keep uninitialised memory."""
    for name, buffer in module.named_buffers():
        if buffer.is_meta:  # computed from a (meta) parameter in the constructor: its value is lost
            raise ConfigError(
                f"model buffer {name} is computed from a parameter in the constructor: "
                "a unit-by-unit build cannot reproduce it"
            )
    if _hf_rule(module):
        return
    for name, mod in module.named_modules():
        if next(mod.parameters(recurse=False), None) is None:
            continue
        if not (hasattr(mod, "reset_parameters") or hasattr(mod, "_reset_parameters")):
            first = next(n for n, _ in mod.named_parameters(recurse=False))
            raise ConfigError(
                f"model parameter {name + '.' if name else ''}{first} ({type(mod).__name__}) has no "
                "reset_parameters(): a unit-by-unit build cannot initialise it"
            )


def materialise(module: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on ``device`` for every meta parameter that is not a DTensor
    (parameters shared by two modules stay shared), and the buffers on ``device``. New
    Parameter objects replace the meta ones: build the optimizer after this."""
    fresh: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for mod in module.modules():
            for name, param in mod._parameters.items():
                if param is None or isinstance(param, DTensor) or not param.is_meta:
                    continue
                if id(param) not in fresh:
                    fresh[id(param)] = nn.Parameter(_unwritten(param, device), requires_grad=param.requires_grad)
                mod._parameters[name] = fresh[id(param)]
            for name, buffer in mod._buffers.items():
                if buffer is not None and buffer.device != device:
                    mod._buffers[name] = _moved(buffer, device)


def _unwritten(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Storage for a parameter its unit's initialisation must write: NaN where the dtype has
    one, so that a parameter the initialisation skipped is seen (:func:`_check_written`)."""
    out = torch.empty_like(like, device=device)
    return out.fill_(float("nan")) if out.is_floating_point() or out.is_complex() else out


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_like(tensor, device=device)
    return out if tensor.is_meta else out.copy_(tensor)


def initialise_by_unit(module: nn.Module, seed: int, host: torch.device, groups=None) -> None:
    """Initialise ``module`` unit by unit (``groups``: :func:`init_groups` of the bare model,
    found before a strategy wrapped it: FSDP renames the units' classes, which Hugging
    Face's ``_no_split_modules`` names), each group from :func:`unit_seed`. A sharded
    (DTensor) parameter is drawn whole in a temporary on ``host`` and this rank keeps its
    shard of it: one unit at a time is whole."""
    names = _parameter_names(module)
    with torch.no_grad():
        for index, group in enumerate(init_groups(module) if groups is None else groups):
            torch.manual_seed(unit_seed(seed, index))
            whole: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
            swapped = []
            for mod in group:
                for name, param in mod._parameters.items():
                    if isinstance(param, DTensor):
                        if id(param) not in whole:
                            tmp = _unwritten(torch.empty(param.shape, dtype=param.dtype, device="meta"), host)
                            whole[id(param)] = (param, nn.Parameter(tmp, requires_grad=param.requires_grad))
                        mod._parameters[name] = whole[id(param)][1]
                        swapped.append((mod, name, param))
            own = {id(p) for mod in group for p in mod._parameters.values() if p is not None}
            others = {id(p): (p, _version(p)) for p in module.parameters() if id(p) not in own}
            for mod in group:
                _init_module(module, mod)
            _check_written(group, names)
            _check_untouched(group, others, names)
            for param, full in whole.values():
                param.to_local().copy_(local_shard(full.detach(), param))
            for mod, name, param in swapped:
                mod._parameters[name] = param
            del whole, swapped


def _parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``module`` (FSDP's wrappers keep the names)."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def _version(param: torch.Tensor) -> int:
    """How often ``param``'s values were written in place (a sharded DTensor: its shard's)."""
    return param.to_local()._version if isinstance(param, DTensor) else param._version


def _is_fake(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or is_fake(tensor)


def _check_written(group: list[nn.Module], names: dict[int, str]) -> None:
    """Raise ConfigError naming a parameter of ``group`` its initialisation left unwritten
    (still the NaN :func:`_unwritten` filled it with): it would train from garbage."""
    for mod in group:
        for attr, param in mod._parameters.items():
            if param is None or _is_fake(param) or not (param.is_floating_point() or param.is_complex()):
                continue
            if torch.isnan(param).any():
                name = names.get(id(param), attr)
                raise ConfigError(
                    f"model parameter {name} ({type(mod).__name__}) is not written by its initialisation "
                    f"(reset_parameters or the model's _init_weights): it would start from uninitialised memory; "
                    "initialise every parameter there, or register the model from a plugin (built whole)"
                )


def _check_untouched(group: list[nn.Module], others: dict, names: dict[int, str]) -> None:
    """Raise ConfigError when ``group``'s initialisation wrote a parameter of another unit (a
    root ``reset_parameters`` re-initialising its blocks): under FSDP it would write shards,
    and the weights would differ from DDP's."""
    for param, before in others.values():
        if _version(param) != before:
            raise ConfigError(
                f"the initialisation of {type(group[-1]).__name__} (reset_parameters) also writes model parameter "
                f"{names.get(id(param), '?')}, which another unit initialises: a unit-by-unit build would give "
                "different weights under FSDP than under DDP; initialise each module's own parameters only, or "
                "register the model from a plugin (built whole)"
            )


def local_shard(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's piece of ``full`` as the DTensor ``like`` places it, cut locally (every
    rank drew the same ``full``: nothing is sent). Each sharded mesh dimension splits as
    ``torch.chunk`` does, as DTensor and FSDP2 split (the last ranks may get less, or
    nothing): the piece is found by arithmetic and taken as one view, so a cut over many
    ranks costs one op, not one tensor per rank."""
    mesh = like.device_mesh
    piece = full
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            piece = chunk_of(piece, mesh.size(mesh_dim), placement.dim, mesh.get_local_rank(mesh_dim))
    return piece


def chunk_of(tensor: torch.Tensor, chunks: int, dim: int, index: int) -> torch.Tensor:
    """``torch.chunk(tensor, chunks, dim)[index]``, or an empty piece where chunk gives fewer
    than ``index + 1`` pieces, computed without making the other pieces."""
    size = tensor.size(dim)
    step = -(-size // chunks) if size else 0  # torch.chunk's piece: ceil(size / chunks)
    start = min(index * step, size)
    return tensor.narrow(dim, start, max(0, min(step, size - start)))


def _tied_to_empty(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to_empty(device)``, keeping parameters that are shared (a tied LM head)
    shared: to_empty gives each module its own new tensor when the type changes (meta to
    fake), which would count a tied weight twice."""
    shared: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    module = module.to_empty(device=device)
    for names in (n for n in shared.values() if len(n) > 1):
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    return module


def keep_plain_parameters(module: nn.Module, device: torch.device) -> None:
    """Materialise, on ``device``, the meta parameters FSDP left whole (0-dim ones it does
    not shard), keeping each Parameter object: the optimizer and the strategy were built
    with these objects, and ``to_empty`` alone would replace them with new ones."""
    with torch.no_grad():
        for mod in module.modules():
            for param in mod._parameters.values():
                if param is not None and param.is_meta and not isinstance(param, DTensor):
                    fresh = nn.Parameter(_unwritten(param, device), requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, fresh)


def materialise_shards(module: nn.Module, device: torch.device, offload: bool = False) -> None:
    """Storage for this rank's shards of a sharded meta-device ``module`` (and for the
    parameters FSDP keeps whole), buffers keeping their values, on ``device`` (the host
    under FSDP's CPU offload, whose sharded parameters live there; buffers stay on
    ``device``: the forward reads them there)."""
    home = torch.device("cpu") if offload else device
    buffers = {(id(m), n): b for m in module.modules() for n, b in m._buffers.items() if b is not None}
    keep_plain_parameters(module, home)
    _tied_to_empty(module, home)  # FSDP2's sharded parameters keep their objects: the optimizer holds them
    with torch.no_grad():
        for mod in module.modules():
            for name, buffer in list(mod._buffers.items()):
                before = buffers.get((id(mod), name))
                if buffer is not None and before is not None:
                    mod._buffers[name] = _moved(before, device)


def load_sharded_from_rank0(module: nn.Module, model_cfg, device: torch.device, offload: bool = False) -> None:
    """Materialise a sharded meta-device ``module`` on ``device`` and fill it with
    ``model.pretrained``'s weights: rank 0 loads the whole model on its CPU, and each
    tensor is broadcast from it, one at a time, every rank keeping its own shard (torch's
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``).

    ``offload``: FSDP's CPU offload, whose sharded parameters live in host memory.

    Warning:
        Buffers that are no state-dict entries (a rotary embedding's ``inv_freq``) have no
        value after a meta-device build: they are rank 0's, broadcast too.
    """
    # lazy: torch.distributed.checkpoint, which only loading pretrained weights into shards needs
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    full = build_model(model_cfg, weights=True) if rank0 else None
    materialise_shards(module, device, offload)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, full.state_dict() if rank0 else {}, options=options)
    loaded = dict(full.named_buffers()) if rank0 else {}
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if rank0:
                buffer.copy_(loaded[name])
            dist.broadcast(buffer, src=0)
    del full, loaded


@dataclass
class Materialised:
    module: nn.Module
    """The bare model, every parameter at its initial value."""
    wrapped: Any
    """What ``wrap`` returned (a strategy around the model)."""
    rule: str
    """How the model was made: ``units``, ``whole`` or ``pretrained`` (the module docstring)."""


def materialise_model(
    model_cfg,
    device: torch.device,
    *,
    seed: int,
    freeze=(),
    shards: bool,
    offload: bool,
    wrap: Callable[[nn.Module], Any],
    prepare: Callable[[nn.Module], None] | None = None,
    meta_first: bool = False,
    weights: bool = True,
) -> Materialised:
    """Build the configured model on ``device``, wrapped by ``wrap``, in the one order that
    gives every strategy the same initial weights (the module docstring).

    ``seed``: the job's seed (``trainer.seed``), set before the build and again after it, so
    that what follows (dropout, data) draws the same under every rule. ``shards``: the
    strategy shards parameters (FSDP), which wraps the meta skeleton before any unit is
    drawn; ``offload``: its sharded parameters live in host memory. ``prepare(module)`` is
    called once the skeleton exists, before any parameter has memory (under the ``units``
    rule) and before wrapping: the caller builds its data task, applies its levers and
    starts its tracker there. ``wrap(module)`` wraps the model (builds the optimizer and
    strategy): after initialisation unless ``shards``, before it if so. ``meta_first``
    (``whole`` rule only): build on the meta device, then allocate uninitialised tensors on
    ``device`` (the fake step's way for a model that cannot be built under FakeTensorMode
    directly). ``weights=False``: shapes only (the fake step), ``model.pretrained``'s config
    without its weights.
    """
    torch.manual_seed(seed)  # identical on every rank
    rule = build_rule(model_cfg, weights)
    # Real meta tensors even inside a fake step: a skeleton costs nothing, and buffers keep
    # their values (a fake step then moves them onto its fake device).
    sharded_load = rule == "pretrained" and shards
    if rule == "units":
        try:
            with unset_fake_temporarily(), torch.device("cpu"), parameters_on_meta():
                module = build_model(model_cfg, freeze)
            check_initialisable(module)
        except ConfigError:  # a parameter of its own making, a buffer computed from a weight: built whole
            rule = "whole"
        except Exception:  # noqa: BLE001 -- a constructor that reads a value (Tensor.item()) cannot run on meta
            rule = "whole"
    if rule != "units" and (sharded_load or meta_first):
        with unset_fake_temporarily(), torch.device("meta"):
            module = build_model(model_cfg, freeze)
        if not sharded_load:
            module = _tied_to_empty(module, device)
    elif rule != "units":
        module = build_model(model_cfg, freeze, weights=rule == "pretrained")
        if any(t.device != device for t in (*module.parameters(), *module.buffers())):
            module = module.to(device)  # (a fake step builds on its fake device already)
    if prepare is not None:
        prepare(module)
    # Drawn in host memory whatever the device (a unit at a time under FSDP): the initial
    # weights do not depend on the device a run trains on.
    host = torch.device("cpu")
    groups = init_groups(module) if rule == "units" else None  # before wrapping (FSDP renames classes)
    if rule == "units" and not shards:
        materialise(module, host)
        initialise_by_unit(module, seed, host, groups)
        if host != device:
            module.to(device)
    wrapped = wrap(module)
    if rule == "units" and shards:
        materialise_shards(module, device, offload)
        initialise_by_unit(module, seed, host, groups)
    elif sharded_load:
        load_sharded_from_rank0(module, model_cfg, device, offload=offload)
    torch.manual_seed(seed)  # what follows (dropout, data) draws the same under every rule
    return Materialised(module, wrapped, rule)
