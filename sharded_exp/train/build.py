"""One place wires a run from a config: the model (frozen as configured), the strategy
wrapping it with its optimizer and grad scaler, the data task and the autocast context.

The trainer, the fake step, the benchmarks and the tests all build through
:func:`build_run`, so what they train or measure is the same thing.

    run = build_run(cfg, torch.device("cpu"))
    loss, _ = train_step(run.strategy, [run.task(0, 0, rank)], run.autocast, cfg.trainer.grad_clip)

How the model comes into being, and in which order it is wrapped and initialised, is
:mod:`sharded_exp.models.materialise`'s; this module says what happens at each point of it
(the task, the levers, the tracker, the strategy).
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
from sharded_exp.models.materialise import materialise_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.strategies import STRATEGIES, build_strategy, offloads_to_host
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
    build: str = "units"
    """How the model was made: ``units``, ``whole`` or ``pretrained`` (module docstring)."""


def build_run(
    cfg,
    device: torch.device,
    *,
    with_task: bool = True,
    before_wrap: Callable[[nn.Module], None] | None = None,
    after_build: Callable[[Strategy], None] | None = None,
    wrapping: Callable[[nn.Module], None] | None = None,
    meta_first: bool = False,
    compile: bool = True,
    weights: bool = True,
) -> Run:
    """Build the configured run on ``device`` (needs a process group: the strategy's).

    ``before_wrap(module)`` is called once the model's skeleton exists and the task's own
    tensors exist, before any parameter has memory (under the ``units`` rule) and before
    the strategy wraps the model: a CPU memory tracker starts there, so it counts the
    build (its peak: one unit beyond the shards) and the strategy's buffers as the CUDA
    allocator would, and not the task's (a teacher network is the data source's, never
    on a GPU). ``after_build(strategy)`` is called once every parameter holds its initial
    value: the end of the build. ``wrapping(module)`` is called as the strategy starts to
    wrap the model (before its optimizer is made): after the initialisation unless the
    strategy shards parameters, before it if it does. ``meta_first`` (``whole`` rule only): build on the meta
    device, then allocate uninitialised tensors on ``device`` (the fake step's way for a
    model that cannot be built under FakeTensorMode directly). The trainer's levers
    (activation checkpointing, compile: :mod:`sharded_exp.train.levers`) are applied to
    the model's units before it is wrapped; ``compile=False`` leaves the units eager.
    Gradients are cleared by the strategy's rule for ``trainer.zero_grad`` (``Traits.zero_grad_rule``).

    ``weights=False``: shapes only (the fake step), ``model.pretrained``'s config without
    its weights. How the model is made, and when it is wrapped, is
    :func:`sharded_exp.models.materialise.materialise_model`'s.
    """
    tc = cfg.trainer
    task = None

    def prepare(module: nn.Module) -> None:
        nonlocal task
        task = build_task(cfg.data, cfg.model, tc.batch_size) if with_task else None
        apply_levers(module, tc, compile=compile)
        if before_wrap is not None:
            before_wrap(module)

    def wrap(module: nn.Module) -> Strategy:
        if wrapping is not None:
            wrapping(module)
        spec = optimizer_spec(cfg.optimizer, module, device=device)
        # trainer.zero_grad: a string in a rank's plain config, the enum in a composed one
        return build_strategy(cfg.strategy, module, spec, cfg.precision, device, ZeroGrad(tc.zero_grad))

    built = materialise_model(
        cfg.model,
        device,
        seed=tc.seed,
        freeze=tc.freeze,
        shards=STRATEGIES.builder(cfg.strategy.name).traits.shards_parameters,
        offload=offloads_to_host(cfg.strategy),
        wrap=wrap,
        prepare=prepare,
        meta_first=meta_first,
        weights=weights,
    )
    if after_build is not None:
        after_build(built.wrapped)
    return Run(built.module, built.wrapped, task, precision.autocast(cfg.precision, device.type), built.rule)
