"""Optimizer spec: class, parameter groups and defaults, built by each strategy.

Strategies need the pieces rather than a constructed optimizer: fairscale OSS and
ZeroRedundancyOptimizer take the optimizer *class* and build one per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sharded_exp.config import OptimizerConfig
from sharded_exp.measure.cuda_kernels import target_device

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclass
class OptimizerSpec:
    cls: type[torch.optim.Optimizer]
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    cfg: Any
    device: torch.device | None = None
    """The device the parameters train on (they may still be on the meta device when the
    spec is made: a sharded build materialises them after wrapping)."""

    def build(self) -> torch.optim.Optimizer:
        return self.cls(self.param_groups, **self.defaults)

    def regroup(self, module: nn.Module, device: torch.device | None = None) -> "OptimizerSpec":
        """The same spec over ``module``'s current parameters (FSDP replaces them), on ``device``
        where they train elsewhere than the spec's (CPU offload: on the host)."""
        return optimizer_spec(self.cfg, module, device or self.device)


def param_groups(cfg: OptimizerConfig, module: nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups, as nanoGPT does: 2-D weights decay, biases and norms don't.

    The second group's learning rate is ``lr * no_decay_lr_scale``.
    """
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "lr": cfg.lr * cfg.no_decay_lr_scale},
    ]
    return [g for g in groups if g["params"]]


def optimizer_spec(cfg: OptimizerConfig, module: nn.Module, device: torch.device | None = None) -> OptimizerSpec:
    """The configured optimizer over ``module``'s trainable parameters (on their device).

    The implementation is explicit: torch picks ``foreach`` (one kernel over a whole group,
    with group-sized temporaries) for real CUDA tensors but the per-tensor loop for the fake
    ones of a fake step, so the prediction would miss the step's largest temporaries. Here
    it follows the parameters' device, real or fake alike: foreach on CUDA, per tensor on
    CPU (torch's choice for real tensors on each); a fake step for a GPU, run on CPU
    tensors, gets CUDA's (``cuda_kernels.target_device``). ``optimizer.foreach`` true or
    false overrides that choice, for the run and its fake step alike."""
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    foreach = cfg.get("foreach")
    if foreach is None:  # optimizer.foreach=null: torch's choice for real tensors there
        foreach = target_device(device) == "cuda"
    defaults: dict[str, Any] = {"lr": cfg.lr, "foreach": bool(foreach)}
    if cfg.name in ("adam", "adamw"):
        defaults.update(betas=tuple(cfg.betas), eps=cfg.eps)
    elif cfg.name == "sgd":
        defaults.update(momentum=cfg.momentum)
    return OptimizerSpec(OPTIMIZERS[cfg.name], param_groups(cfg, module), defaults, cfg, device)
