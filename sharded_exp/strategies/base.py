"""The one interface between the trainer and a strategy: its runtime, and the parts it is made of.

A strategy is a class made of parts (as Lightning Fabric's ``Strategy`` is of mixins):

- ``Config``: its config schema (a dataclass; the registry reads it);
- ``traits``: frozen facts about it (:class:`~.traits.Traits`: how much it shards, its
  checkpoint format, what it requires, which wrappers give it away);
- ``memory``: which model states each rank holds (:class:`~.residency.MemoryModel`), read by
  the prediction, the planner and the probe without building anything;
- ``timing``: which collectives a step issues and how they overlap the compute
  (:class:`~.timing.TimeModel`), read by the time model the same way;
- the runtime: what ``build`` returns, the object the trainer steps (zeroing, no-sync,
  clipping, stepping, state). The trainer never asks which strategy it runs.

The defaults here are plain DDP's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from sharded_exp import precision
from sharded_exp.config import Sealed, ZeroGrad
from sharded_exp.strategies.residency import MemoryModel
from sharded_exp.strategies.timing import TimeModel
from sharded_exp.strategies.traits import GradZeroing, Traits


def _gather_owned_state(local: dict[str, dict], params: dict[str, Any]) -> dict[str, dict] | None:
    """Optimizer state owned whole by one rank each, sent to rank 0 tensor by tensor."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = next(iter(params.values())).device  # NCCL sends device tensors only
    held: list[Any] = [None] * world_size
    dist.all_gather_object(held, sorted(local))
    owner = {name: r for r, names in enumerate(held) for name in names}
    out: dict[str, dict] = {}
    for name in params:
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
    return out if rank == 0 else None


@dataclass
class StrategyConfig(Sealed):
    name: str = "ddp"
    """Key in the strategy registry."""


class Strategy:
    """The runtime: a wrapped model with its optimizer and grad scaler, and the parts of the
    strategy it runs (``Config``, ``traits``, ``memory``).

    Args:
        model: the wrapped module the trainer calls (DDP, ShardedDataParallel, ...).
        module: the bare model inside it (for state dicts and parameter walks).
        optimizer: the optimizer the trainer steps (possibly sharded).
        precision_cfg, device: choose the grad scaler (``traits.grads_differ_across_ranks``).

    Besides those four attributes and ``grad_zeroing`` (the rule this instance clears
    gradients by, :meth:`Traits.zero_grad_rule`, set by
    :func:`sharded_exp.strategies.build_strategy`; free unless told otherwise), the class
    keeps to the members below: a fact about a strategy goes to its ``traits``, a rule of
    its memory to its ``memory`` (tests/unit/strategies/test_base.py counts them).
    """

    Config = StrategyConfig
    """The schema of this strategy's config group option (a dataclass)."""
    traits = Traits()
    """What this strategy is (:class:`~.traits.Traits`)."""
    memory = MemoryModel
    """Which model states each rank holds (:class:`~.residency.MemoryModel`)."""
    timing = TimeModel
    """Which collectives a step issues and how they overlap (:class:`~.timing.TimeModel`)."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer, precision_cfg, device):
        self.model = model
        self.module = module
        self.optimizer = optimizer
        self.scaler = precision.grad_scaler(
            precision_cfg, device.type, sharded_grads=self.traits.grads_differ_across_ranks
        )
        self.grad_zeroing = GradZeroing(ZeroGrad.free, ZeroGrad.free)

    @classmethod
    def check(cls, cfg, world_size: int, device_type: str) -> None:
        """Refuse settings this job cannot run (raise ConfigError naming them), before any
        rank starts: called once the device and the world size are decided."""

    @classmethod
    def build(cls, cfg, module: nn.Module, optim_spec, precision_cfg, device: torch.device) -> "Strategy":
        """Wrap ``module`` (on ``device``) and build the optimizer from ``optim_spec``."""
        raise NotImplementedError

    # --------------------------------------------------------------------- run time
    def zero_grad(self) -> None:
        # free (set_to_none) releases gradient memory until the backward; zeros keeps it
        # allocated through the forward. Either is exact under torch DDP.
        self.optimizer.zero_grad(set_to_none=self.grad_zeroing.set_to_none)

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
        """Parameters whose optimizer state this rank holds (every trainable one without sharding)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def gather_optimizer_state(self, local: dict[str, dict], params: dict[str, Any]) -> dict[str, dict] | None:
        """The full optimizer state by parameter name, on rank 0's CPU (None elsewhere), one
        tensor at a time (a collective). ``local``: this rank's state by parameter name.

        Where each rank holds the state of every parameter, whole or as DTensor shards
        (FSDP2), each tensor is all-gathered alone. Where ranks own whole tensors' state
        (``traits.optimizer_state_sharded``: OSS, ZeRO-1), each is sent to rank 0 by its
        owner, from the device it lives on (no host copy on the owner).
        """
        if self.traits.optimizer_state_sharded and dist.get_world_size() > 1:
            return _gather_owned_state(local, params)
        rank, out = dist.get_rank(), {}
        for name, state in local.items():
            for key, value in state.items():
                full = value.full_tensor() if isinstance(value, DTensor) else value  # collective for DTensors
                if rank == 0:
                    out.setdefault(name, {})[key] = full.detach().to("cpu", copy=True)
                del full
        return out if rank == 0 else None

    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The plain torch optimizers on this rank, whose state is this rank's share."""
        return [self.optimizer]
