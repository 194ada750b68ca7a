"""fsdp: PyTorch FSDP2 ``fully_shard`` (ZeRO stage 3: parameters, gradients and optimizer
state sharded), and fsdp_grad_op: the same without resharding after forward (ZeRO-2-like:
parameters stay gathered from forward to backward).

Levers (settings of both): ``replicate=R`` makes it HSDP, a 2-D mesh of R replica groups
of world_size/R ranks each (states shard within a group, gradients are also all-reduced
across groups); ``param_dtype`` / ``reduce_dtype`` set FSDP's mixed-precision policy (by
default from ``precision``); ``cpu_offload`` keeps the sharded parameters, gradients and
optimizer state in pinned host memory and steps the optimizer on the CPU (FSDP2's
``CPUOffloadPolicy``; a GPU run only).

Each of the model's units (``sharding_units()``, else Hugging Face's ``_no_split_modules``, else its
repeated children: :func:`sharded_exp.models.units`) is one FSDP unit, and the root holds
the rest (a tied embedding and LM head stay together there). Every
parameter is a DTensor sharded on dim 0 across ranks; a unit's parameters are all-gathered
just before use and its gradients reduce-scattered after backward. Precision 16/bf16 runs
through FSDP's MixedPrecisionPolicy: parameters and compute in half, gradient reduction
and the sharded master weights in fp32.
"""

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from sharded_exp import precision
from sharded_exp.config import Option, bounded, check_bounds
from sharded_exp.errors import ConfigError
from sharded_exp.models import units
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import Strategy, StrategyConfig
from sharded_exp.strategies.residency import MemoryModel
from sharded_exp.strategies.timing import FSDPTime
from sharded_exp.strategies.traits import Traits


def _value(option) -> str:
    return str(option)


def _shard_numel(shape: tuple, rank: int, world_size: int) -> int:
    """Elements of a dim-0 shard, as torch.chunk splits them (the last ranks may get
    fewer); a 0-dim parameter is held whole by every rank (see :meth:`FSDP.build`)."""
    if not shape:
        return 1
    chunk = math.ceil(shape[0] / world_size)
    return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])


def _padded_numel(shape: tuple, world_size: int) -> int:
    """Elements of a rank's dim-0 shard in FSDP's storage, padded to equal chunks."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:]) if shape else 1


def _broadcast_buffers_before_forward(module: torch.nn.Module) -> None:
    """Rank 0's persistent buffers to every rank before each forward, training and
    evaluation (DDP's ``broadcast_buffers``): the ranks evaluate with the same statistics.
    The buffers are looked up at each forward: a model built on the meta device gets new
    buffer tensors when it is materialised after wrapping (sharded_exp.train.build)."""

    def persistent():
        return [
            b
            for m in module.modules()
            for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set
        ]

    if not persistent():
        return

    def broadcast(mod, args, kwargs):
        for b in persistent():
            torch.distributed.broadcast(b, src=0)

    module.register_forward_pre_hook(broadcast, with_kwargs=True)


def shard_group(cfg, world_size: int) -> int:
    """Ranks a state is sharded over: all of them, or one HSDP replica group."""
    return world_size // max(1, cfg.replicate)


def policy(cfg, precision_cfg) -> MixedPrecisionPolicy:
    """FSDP's mixed-precision policy: the asked dtypes, else the precision's compute dtype
    for parameters and float32 for the reduction."""
    half = precision.compute_dtype(precision_cfg.name)
    param = getattr(torch, _value(cfg.param_dtype)) if cfg.param_dtype is not None else half
    reduce = getattr(torch, _value(cfg.reduce_dtype)) if cfg.reduce_dtype is not None else torch.float32
    if param is None and cfg.reduce_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


class DType(Option):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class FSDPConfig(StrategyConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True
    """Free gathered parameters after forward and gather again in backward (ZeRO-3)."""
    broadcast_buffers: bool = True
    """Broadcast the model's buffers (BatchNorm's running statistics) from rank 0 before
    every forward, as DDP does by default; FSDP itself leaves each rank its own."""
    replicate: int = bounded(1, at_least=1, divides_world_size="HSDP: replica groups of equal size")
    """HSDP: R replica groups of world_size/R ranks; states shard within a group only
    (each rank holds 1/(world_size/R) of them), gradients are all-reduced across groups.
    1: plain FSDP over every rank. Must divide trainer.world_size."""
    param_dtype: Optional[DType] = None
    """dtype of the gathered parameters and of the compute (null: from precision, i.e.
    float32 at 32, bfloat16 at bf16, float16 at 16); the sharded master weights stay float32."""
    reduce_dtype: Optional[DType] = None
    """dtype the gradients are reduced in (null: float32)."""
    cpu_offload: bool = False
    """Sharded parameters, gradients and optimizer state in pinned host memory, the
    optimizer step on the CPU (FSDP2's CPUOffloadPolicy). GPU runs only."""


@dataclass
class FSDPGradOpConfig(FSDPConfig):
    name: str = "fsdp_grad_op"
    reshard_after_forward: bool = False
    """Keep gathered parameters from forward to backward (ZeRO-2-like)."""


class FSDPMemory(MemoryModel):
    """Every state sharded by rows over the shard group; the root and one unit (or every
    unit, without resharding) gathered on top at the peak."""

    # Forward prefetch gathers the next unit while one computes, and backward the one
    # before: only from three blocks on does each further block add the same.
    depth_line_from = 3
    # FSDP2 allocates its all-gather buffers in the copy-in stream (forward first), the
    # reduce-scatter outputs (the new sharded gradients) in the reduce-scatter stream, and
    # HSDP's all-reduce outputs in the all-reduce stream (torch's _fsdp_collectives.py).
    side_streams = ("fsdp all-gather copy-in", "fsdp reduce-scatter", "fsdp all-reduce")

    @staticmethod
    def partition(group_numels, world_size):
        return [-1 for group in group_numels for _ in group]  # every rank owns a slice of each

    @classmethod
    def transient_param_numel(cls, cfg, block_numels, root_numel, world_size):
        # The root unit stays gathered from forward to backward (FSDP2 does not reshard the
        # root). With resharding, one block is gathered on top at a time (measured peak on
        # CPU; prefetching can add the next block); without it, every block stays gathered.
        if cfg.reshard_after_forward:
            return root_numel + max(block_numels, default=0)
        return root_numel + sum(block_numels)

    @classmethod
    def resident_numel(cls, cfg, shapes, owners, rank, world_size):
        # HSDP: sharded within a replica group (rank r is member r % group of its group)
        world_size = shard_group(cfg, world_size)
        rank = rank % world_size
        rows = [_shard_numel(s, rank, world_size) for s in shapes]
        # Sharded parameters and gradients live in storage padded to equal dim-0 chunks on
        # every rank; optimizer state is allocated like the unpadded local shard.
        padded = sum(_padded_numel(s, world_size) for s in shapes)
        return {"params": padded, "grads": padded, "optimizer": rows}

    @classmethod
    def pinned_numels(cls, cfg, shapes, frozen, rank, world_size) -> list[int]:
        """CPU offload: the element count of each tensor ``rank`` pins in host memory, one
        block each (:mod:`sharded_exp.predict.host_memory`): every parameter's padded shard
        (``shapes``, then the ``frozen`` ones) and every trainable parameter's gradient shard,
        unpadded (its own rows, copied out of the reduce-scatter's padded output)."""
        group = shard_group(cfg, world_size)
        params = [_padded_numel(s, group) for s in [*shapes, *frozen]]
        return params + [_shard_numel(s, rank % group, group) for s in shapes]


@STRATEGIES.register("fsdp")
class FSDP(Strategy):
    Config = FSDPConfig
    traits = Traits(
        sharding=4,
        shards_parameters=True,
        host_offload="cpu_offload",
        wrappers=(
            "torch.distributed.fsdp.FSDPModule",  # FSDP2's fully_shard
            "torch.distributed.fsdp.FullyShardedDataParallel:FULL_SHARD",
            "torch.distributed.fsdp.FullyShardedDataParallel:HYBRID_SHARD",
        ),
        grads_differ_across_ranks=True,  # sharded gradients: the scaler agrees on inf/nan
    )
    memory = FSDPMemory
    timing = FSDPTime

    @classmethod
    def check(cls, cfg, world_size: int, device_type: str) -> None:
        check_bounds("strategy", cfg, FSDPConfig, world_size)  # strategy.replicate divides it (a plan's each size)
        if cfg.cpu_offload and device_type != "cuda":
            raise ConfigError(
                f"strategy.cpu_offload=true moves states from the GPU to host memory; this run is on {device_type}, "
                "where they are in host memory already: use it on a GPU (trainer.accelerator=gpu), or plan it "
                "(python -m sharded_exp.plan strategy.cpu_offload=true)"
            )

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        world_size = torch.distributed.get_world_size()
        with unset_fake_temporarily():  # a mesh is bookkeeping: real even in a fake step
            if cfg.replicate > 1:
                shape, names = (cfg.replicate, shard_group(cfg, world_size)), ("replicate", "shard")
                mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
            else:
                mesh = init_device_mesh(device.type, (world_size,))
        half = precision.compute_dtype(precision_cfg.name)
        mp_policy = policy(cfg, precision_cfg)
        offload = {}
        if cfg.cpu_offload:
            offload = {"offload_policy": CPUOffloadPolicy(pin_memory=True)}
        # fully_shard refuses 0-dim parameters (a learnable temperature or scale): they stay
        # whole on every rank, outside FSDP, and their gradients are averaged here, as DDP would.
        scalars = {p for p in module.parameters() if p.dim() == 0} or None
        if half:
            # BatchNorm keeps its running statistics in fp32; its weight and bias cast to
            # half beside them fail on CPU ("expected scalar type BFloat16 but found Float").
            # It is a unit of its own in fp32, as autocast runs it under DDP.
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            for norm in [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]:
                fully_shard(
                    norm,
                    mesh=mesh,
                    reshard_after_forward=cfg.reshard_after_forward,
                    mp_policy=fp32,
                    ignored_params=scalars,
                    **offload,
                )
        for block in units(module):
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=cfg.reshard_after_forward,
                mp_policy=mp_policy,
                ignored_params=scalars,
                **offload,
            )
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=mp_policy,
            ignored_params=scalars,
            **offload,
        )
        if cfg.broadcast_buffers:
            _broadcast_buffers_before_forward(module)
        # fully_shard replaced the parameters by DTensors: group and build the optimizer now. Under
        # CPU offload they, their gradients and the optimizer's state are host tensors and the step
        # runs there: built as torch builds one for CPU tensors (per tensor, unless optimizer.foreach
        # says), not CUDA's foreach, whose new tensors would span a whole parameter group at once in
        # host memory (sharded_exp/predict/host_memory.py).
        on = torch.device("cpu") if cfg.cpu_offload else None
        self = cls(module, module, optim_spec.regroup(module, on).build(), precision_cfg, device)
        self._replicated = [p for p in scalars or () if p.requires_grad]
        return self

    def __init__(self, model, module, optimizer, precision_cfg, device):
        super().__init__(model, module, optimizer, precision_cfg, device)
        self._replicated: list = []
        """0-dim parameters, whole on every rank (not DTensors): gradients averaged by us."""
        self._reduced = False

    def zero_grad(self) -> None:
        super().zero_grad()
        self._reduced = False

    def _reduce_replicated(self) -> None:
        """Average the replicated parameters' gradients over the ranks, once per step
        (after the last micro-batch: accumulation sums locally, as DDP's no_sync does)."""
        if self._reduced or not self._replicated:
            return
        world_size = torch.distributed.get_world_size()
        for p in self._replicated:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world_size)
        self._reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if not self._replicated:
            return super().clip_grad_norm_(max_norm)
        self._reduce_replicated()
        params = [p for p in self.module.parameters() if p.grad is not None]
        sharded = [p.grad for p in params if isinstance(p.grad, DTensor)]
        whole = [p.grad for p in params if not isinstance(p.grad, DTensor)]
        norms = [torch.nn.utils.get_total_norm(sharded), torch.nn.utils.get_total_norm(whole)]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def optimizer_step(self) -> None:
        self._reduce_replicated()
        super().optimizer_step()

    def no_sync(self):
        @contextlib.contextmanager
        def skip_reduce():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

        return skip_reduce()

    def local_shard(self) -> list:
        # every rank holds a slice of every trainable parameter's state
        return [p for p in self.module.parameters() if p.requires_grad]


@STRATEGIES.register("fsdp_grad_op")
class FSDPGradOp(FSDP):
    Config = FSDPGradOpConfig
    traits = dataclasses.replace(
        FSDP.traits,
        sharding=3,
        wrappers=(
            "torch.distributed.fsdp.FullyShardedDataParallel:SHARD_GRAD_OP",
            "torch.distributed.fsdp.FullyShardedDataParallel:_HYBRID_SHARD_ZERO2",
        ),
    )
