"""The one interface between the trainer and a strategy, and its memory model.

A strategy is one class: its config schema (``Config``), how it builds the wrapped model,
optimizer and grad scaler (``build``), what it does at run time (zeroing, no-sync,
clipping, stepping, state), and which model states each rank holds (the memory-model
class methods, read by :mod:`sharded_exp.predict.prediction` without building anything).
The trainer never asks which strategy it runs. The defaults here are plain DDP's.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from sharded_exp import precision
from sharded_exp.config import ZeroGrad


def greedy_partition(group_numels: Sequence[Sequence[int]], world_size: int, largest_first: bool = False) -> list[int]:
    """Owner rank of every parameter (flattened in group order), as fairscale OSS assigns it:
    each to the rank with the least so far, the lowest rank among equals (a heap: a plan at
    10,000 ranks takes milliseconds). ``largest_first``: each group's parameters in order of
    size, largest first (torch's ZeroRedundancyOptimizer)."""
    heap = [(0, rank) for rank in range(world_size)]
    owners = []
    for group in group_numels:
        order = sorted(range(len(group)), key=lambda i: -group[i]) if largest_first else range(len(group))
        group_owners = [0] * len(group)
        for i in order:
            size, rank = heapq.heappop(heap)
            group_owners[i] = rank
            heapq.heappush(heap, (size + group[i], rank))
        owners += group_owners
    return owners


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


@dataclass(frozen=True)
class GradZeroing:
    """How a strategy clears gradients at the start of each step: the rule
    ``trainer.zero_grad`` asked for, the rule the strategy applies, and why they differ."""

    requested: ZeroGrad
    applied: ZeroGrad
    reason: str = ""
    """Empty when ``applied`` is ``requested``."""

    @property
    def set_to_none(self) -> bool:
        return self.applied is ZeroGrad.free

    def record(self) -> dict[str, Any]:
        """result.json's ``zero_grad``."""
        return {"requested": self.requested.value, "applied": self.applied.value, "reason": self.reason or None}


@dataclass
class StrategyConfig:
    name: str = "ddp"
    """Key in the strategy registry."""


class Strategy:
    """A wrapped model with its optimizer and grad scaler.

    Args:
        model: the wrapped module the trainer calls (DDP, ShardedDataParallel, ...).
        module: the bare model inside it (for state dicts and parameter walks).
        optimizer: the optimizer the trainer steps (possibly sharded).
        precision_cfg, device: choose the grad scaler (see ``grads_differ_across_ranks``).
    """

    Config = StrategyConfig
    """The schema of this strategy's config group option (a dataclass)."""
    requires: tuple[str, ...] = ()
    """Packages beyond our core dependencies that this strategy imports (checked before spawn)."""
    optimizer_state_sharded = False
    """True when each rank's local optimizers hold the state of its own parameters only
    (OSS, ZeRO-1): checkpoints gather the shards, the memory model counts the owned ones.
    FSDP2's DTensor state is sharded as tensors instead."""
    shards_parameters = False
    """True when no rank holds the whole model (FSDP2): nothing may gather it onto one rank
    unasked, and checkpoints default to the sharded format."""
    sharding: int | None = None
    """How much of the model state the ranks divide among them, to order strategies from
    the least sharded (reports, the planner's "cheapest that fits"): 0 nothing (DDP),
    1 the optimizer state (OSS, ZeRO-1), 2 and the gradients (ShardedDDP), 3 and the
    parameters outside forward and backward (FSDP's SHARD_GRAD_OP), 4 everything (FSDP).
    None: from the flags above (:meth:`sharding_level`)."""
    default_checkpoint_format: str | None = None
    """``trainer.checkpoint_format=auto``: None means consolidated (one full copy, written by
    rank 0) where one rank holds everything, dcp (each rank its own shards) where the
    strategy shards something, as the product cannot know that one rank could hold it all."""
    clip_reads_values = False
    """True when clipping branches on the norm's value (fairscale OSS): a fake step, which
    has no values, then runs without clipping (it scales in place: no memory)."""
    grads_differ_across_ranks = False
    """True when ranks check different gradients for inf/nan (sharded gradients or sharded
    optimizer steps): the grad scaler must then agree on the found-inf flag across ranks."""
    depth_line_from = 1
    """The shallowest depth (blocks) from which each part of a fake step's peak grows on a
    line as the model deepens under this strategy: the planner fakes a deep model at this
    depth and the two above it and draws the rest (sharded_exp.plan.depth)."""
    depth_lines_per_world_size = False
    """True when whether the peak lies on a line in depth depends on the world size (the
    planner then checks the line at every world size, not at the first alone)."""
    zero_grad_fixed: ZeroGrad | None = None
    """The one rule by which this strategy clears gradients, whatever ``trainer.zero_grad``
    asks (ShardedDDP: zeros in place), with its reason in ``zero_grad_fixed_reason``; None:
    it follows ``trainer.zero_grad``."""
    zero_grad_fixed_reason = ""
    grad_zeroing = GradZeroing(ZeroGrad.free, ZeroGrad.free)
    """The rule this instance applies (:meth:`zero_grad_rule`, set by
    :func:`sharded_exp.strategies.build_strategy`); free unless told otherwise."""

    def __init__(self, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer, precision_cfg, device):
        self.model = model
        self.module = module
        self.optimizer = optimizer
        self.scaler = precision.grad_scaler(precision_cfg, device.type, sharded_grads=self.grads_differ_across_ranks)

    @classmethod
    def check(cls, cfg, world_size: int, device_type: str) -> None:
        """Refuse settings this job cannot run (raise ConfigError naming them), before any
        rank starts: called once the device and the world size are decided."""

    @classmethod
    def build(cls, cfg, module: nn.Module, optim_spec, precision_cfg, device: torch.device) -> "Strategy":
        """Wrap ``module`` (on ``device``) and build the optimizer from ``optim_spec``."""
        raise NotImplementedError

    @classmethod
    def zero_grad_rule(cls, requested: ZeroGrad) -> GradZeroing:
        """The rule this strategy applies when ``trainer.zero_grad`` asks for ``requested``."""
        if cls.zero_grad_fixed is None or cls.zero_grad_fixed is requested:
            return GradZeroing(requested, requested)
        return GradZeroing(requested, cls.zero_grad_fixed, cls.zero_grad_fixed_reason)

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
        (``optimizer_state_sharded``: OSS, ZeRO-1), each is sent to rank 0 by its owner,
        from the device it lives on (no host copy on the owner).
        """
        if self.optimizer_state_sharded and dist.get_world_size() > 1:
            return _gather_owned_state(local, params)
        rank, out = dist.get_rank(), {}
        for name, state in local.items():
            for key, value in state.items():
                full = value.full_tensor() if isinstance(value, DTensor) else value  # collective for DTensors
                if rank == 0:
                    out.setdefault(name, {})[key] = full.detach().to("cpu", copy=True)
                del full
        return out if rank == 0 else None

    @classmethod
    def sharding_level(cls) -> int:
        """``sharding``, or what the flags say where a strategy does not set it."""
        if cls.sharding is not None:
            return cls.sharding
        return 4 if cls.shards_parameters else 1 if cls.optimizer_state_sharded else 0

    @classmethod
    def checkpoint_format_auto(cls) -> str:
        """The format ``trainer.checkpoint_format=auto`` takes (``default_checkpoint_format``)."""
        if cls.default_checkpoint_format is not None:
            return cls.default_checkpoint_format
        return "dcp" if cls.shards_parameters or cls.optimizer_state_sharded else "consolidated"

    @classmethod
    def offloads_to_host(cls, cfg) -> bool:
        """Does this strategy, as ``cfg`` (its config group) sets it, keep model states in
        host memory? By default: its ``cpu_offload`` setting, if it has one."""
        return bool(cfg.get("cpu_offload", False))

    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The plain torch optimizers on this rank, whose state is this rank's share."""
        return [self.optimizer]

    # ----------------------------------------------------------------- memory model
    @staticmethod
    def partition(group_numels, world_size: int) -> list[int]:
        """Owner rank of each parameter's optimizer state (fairscale OSS's greedy rule)."""
        return greedy_partition(group_numels, world_size)

    @staticmethod
    def owned(numels, owners, rank: int) -> list[int]:
        """The sizes of the tensors whose optimizer state ``rank`` owns (the ZeRO-1 rule)."""
        return [n for n, o in zip(numels, owners) if o == rank]

    @classmethod
    def transient_param_numel(cls, cfg, block_numels, root_numel: int, world_size: int) -> int:
        """Parameter elements gathered on top of the resident ones at the peak (none here).

        ``block_numels``: the model's units' sizes (``models.units``); ``root_numel``: everything else.
        """
        return 0

    @classmethod
    def bucket_numel(cls, cfg, numels, owners, rank: int, world_size: int) -> tuple[int, int]:
        """Elements of the communication buckets ``rank`` keeps for the whole run (allocated
        when the model is wrapped), and how many of those elements are also its gradients
        (gradients that are views into a bucket): ``(0, 0)`` without buckets.

        ``numels``: the trainable parameters' sizes; ``owners``: their optimizer-shard rank."""
        return 0, 0

    @classmethod
    def setup_transient_mib(cls, cfg, shapes, world_size: int) -> float:
        """MiB this strategy allocates for a moment while it sets up (beyond what it keeps):
        a deep model's peak is composed from shallow ones only where this moment cannot be
        the peak (sharded_exp.plan.depth). Nothing by default."""
        return 0.0

    @classmethod
    def resident_numel(cls, cfg, shapes, owners, rank: int, world_size: int) -> dict:
        """Elements of each model state that ``rank`` holds (for the memory model).

        ``shapes``: every parameter's shape; ``owners``: its optimizer-shard rank.
        Returns ``params`` and ``grads`` element counts and ``optimizer``, the sizes of the
        tensors whose optimizer state the rank keeps: all of them, or its own shard's when
        ``optimizer_state_sharded``.
        """
        numels = [math.prod(s) for s in shapes]
        optimizer = cls.owned(numels, owners, rank) if cls.optimizer_state_sharded else numels
        return {"params": sum(numels), "grads": sum(numels), "optimizer": optimizer}
