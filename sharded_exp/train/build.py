"""One place wires a run from a config: the model (frozen as configured), the strategy
wrapping it with its optimizer and grad scaler, the data task and the autocast context.

The trainer, the fake step, the benchmarks and the tests all build through
:func:`build_run`, so what they train or measure is the same thing.

    run = build_run(cfg, torch.device("cpu"))
    loss, _ = train_step(run.strategy, [run.task(0, 0, rank)], run.autocast, cfg.trainer.grad_clip)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sharded_exp import precision
from sharded_exp.config import ZeroGrad
from sharded_exp.data import Task, build_task
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.strategies import STRATEGIES, build_strategy
from sharded_exp.strategies.base import Strategy
from sharded_exp.train.levers import apply_levers


@dataclass
class Run:
    module: nn.Module
    """The bare model (parameters, state dicts)."""
    strategy: Strategy
    """The wrapped model, its optimizer and grad scaler."""
    task: Task | None
    """``task(step, micro, rank) -> batch``; None when not asked for."""
    autocast: Any
    """The precision's autocast context (a no-op at 32)."""


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
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for mod in module.modules():
            for param in mod._parameters.values():
                if param is not None and param.is_meta and not isinstance(param, DTensor):
                    fresh = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, fresh)


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
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    full = build_model(model_cfg, weights=True) if rank0 else None
    # FSDP's CPU offload keeps the sharded parameters in host memory (it refuses them on the GPU).
    home = torch.device("cpu") if offload else device
    keep_plain_parameters(module, home)
    _tied_to_empty(module, home)  # FSDP2's sharded parameters keep their objects: the optimizer holds them
    if home != device:  # buffers are not offloaded: the forward reads them on the GPU
        for mod in module.modules():
            for name, buffer in mod._buffers.items():
                if buffer is not None:
                    mod._buffers[name] = buffer.to(device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, full.state_dict() if rank0 else {}, options=options)
    loaded = dict(full.named_buffers()) if rank0 else {}
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if rank0:
                buffer.copy_(loaded[name])
            dist.broadcast(buffer, src=0)
    del full, loaded


def build_run(
    cfg,
    device: torch.device,
    *,
    with_task: bool = True,
    before_wrap: Callable[[nn.Module], None] | None = None,
    meta_first: bool = False,
    compile: bool = True,
    weights: bool = True,
) -> Run:
    """Build the configured run on ``device`` (needs a process group: the strategy's).

    ``before_wrap(module)`` is called once the model is on its device and the task's own
    tensors exist, before the strategy wraps the model: a CPU memory tracker starts there,
    so it counts the strategy's buffers as the CUDA allocator would, and not the task's
    (a teacher network is the data source's, never on a GPU). ``meta_first``: build on the
    meta device, then allocate uninitialised tensors on ``device`` (the fake step's way
    for a model that cannot be built under FakeTensorMode directly). The trainer's levers
    (activation checkpointing, compile: :mod:`sharded_exp.train.levers`) are applied to the
    model's units before it is wrapped; ``compile=False`` leaves the units eager. Gradients
    are cleared by the strategy's rule for ``trainer.zero_grad`` (``Strategy.zero_grad_rule``).

    ``model.pretrained``'s weights are loaded unless ``weights=False`` (the fake step's
    shapes-only build): by every rank when every rank holds the whole model; under a
    strategy that shards parameters (FSDP) the model is built on the meta device, wrapped,
    and each rank then keeps its shard of what rank 0 alone loaded
    (:func:`load_sharded_from_rank0`), so no other rank ever holds the whole model.
    """
    tc = cfg.trainer
    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    pretrained = weights and bool(cfg.model.get("pretrained"))
    sharded_load = pretrained and STRATEGIES.builder(cfg.strategy.name).shards_parameters
    if meta_first or sharded_load:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.device("meta"):
            module = build_model(cfg.model, tc.freeze)
        if not sharded_load:
            module = _tied_to_empty(module, device)
    else:
        module = build_model(cfg.model, tc.freeze, weights=pretrained)
    if not sharded_load and any(t.device != device for t in (*module.parameters(), *module.buffers())):
        module = module.to(device)  # (a fake step builds on its fake device already)
    task = build_task(cfg.data, cfg.model, tc.batch_size) if with_task else None
    apply_levers(module, tc, compile=compile)
    if before_wrap is not None:
        before_wrap(module)
    spec = optimizer_spec(cfg.optimizer, module)
    # trainer.zero_grad: a string in a rank's plain config, the enum in a composed one
    strategy = build_strategy(cfg.strategy, module, spec, cfg.precision, device, ZeroGrad(tc.zero_grad))
    if sharded_load:
        load_sharded_from_rank0(module, cfg.model, device, offload=bool(cfg.strategy.get("cpu_offload")))
    return Run(module, strategy, task, precision.autocast(cfg.precision, device.type))
