"""The one interface between the trainer and a strategy.

The trainer never asks which strategy it runs: everything that differs between them
(wrapping, optimizer, grad scaler, clipping, zeroing, gradient sync, full state) sits
behind :class:`Strategy`. The defaults here are plain DDP's behaviour.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sharded_exp.memory_model import greedy_partition


@dataclass
class StrategyConfig:
    name: str = "ddp"
    """Key in the strategy registry."""

    @staticmethod
    def partition(group_numels, world_size: int) -> list:
        """Owner rank of each parameter's optimizer state (fairscale OSS's greedy rule)."""
        return greedy_partition(group_numels, world_size)

    @staticmethod
    def transient_param_numel(cfg, block_numels, root_numel: int, world_size: int) -> int:
        """Parameter elements gathered on top of the resident ones at the peak (none here).

        ``block_numels``: the model's ``blocks()`` sizes; ``root_numel``: everything else.
        """
        return 0

    @staticmethod
    def resident_numel(cfg, shapes, owners, rank: int, world_size: int) -> dict:
        """Elements of each model state that ``rank`` holds (for the memory model).

        ``shapes``: every parameter's shape; ``owners``: its optimizer-shard rank.
        Returns ``params`` and ``grads`` element counts and ``optimizer``, the sizes of the
        tensors whose optimizer state the rank keeps. Unsharded by default.
        """
        numels = [math.prod(s) for s in shapes]
        return {"params": sum(numels), "grads": sum(numels), "optimizer": numels}


class Strategy:
    """A wrapped model with its optimizer and grad scaler.

    Args:
        model: the wrapped module the trainer calls (DDP, ShardedDataParallel, ...).
        module: the bare model inside it (for state dicts and parameter walks).
        optimizer: the optimizer the trainer steps (possibly sharded).
        scaler: a GradScaler; disabled (pass-through) unless precision=16.
    """

    optimizer_state_sharded = False
    """True when each rank's local optimizers hold the state of its own parameters only
    (OSS, ZeRO-1): checkpoints gather the shards. FSDP2's DTensor state is gathered as such."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any):
        self.model = model
        self.module = module
        self.optimizer = optimizer
        self.scaler = scaler

    def zero_grad(self) -> None:
        # set_to_none frees gradient memory between steps; safe for torch DDP.
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for micro-batches that accumulate gradients without communicating."""
        return self.model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def optimizer_step(self) -> None:
        """Step through the scaler (skipped on inf/nan at precision=16) and update the scale."""
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def local_shard(self) -> list[nn.Parameter]:
        """Parameters whose optimizer state this rank holds (all of them without sharding)."""
        return list(self.module.parameters())

    def inject_inf_grad(self) -> Any:
        """Testing aid (fault ``inf_grad``): make one gradient element of this rank's own
        shard inf, before any communication. Returns a handle with ``remove()``."""
        param = self.local_shard()[0]
        return param.register_hook(lambda g: torch.full_like(g, float("inf")))

    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The plain torch optimizers on this rank, whose state is this rank's share."""
        return [self.optimizer]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state. Collective: call on every rank."""
        return {k: v.detach() for k, v in self.module.state_dict().items()}
