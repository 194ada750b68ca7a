"""fsdp: PyTorch FSDP2 ``fully_shard`` (ZeRO stage 3: parameters, gradients and optimizer
state sharded), and fsdp_grad_op: the same without resharding after forward (ZeRO-2-like:
parameters stay gathered from forward to backward).

Each of the model's units (``blocks()``, else Hugging Face's ``_no_split_modules``, else its
repeated children: :func:`sharded_exp.models.units`) is one FSDP unit, and the root holds
the rest (a tied embedding and LM head stay together there). Every
parameter is a DTensor sharded on dim 0 across ranks; a unit's parameters are all-gathered
just before use and its gradients reduce-scattered after backward. Precision 16/bf16 runs
through FSDP's MixedPrecisionPolicy: parameters and compute in half, gradient reduction
and the sharded master weights in fp32.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from sharded_exp import precision
from sharded_exp.models import units
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import Strategy, StrategyConfig


def _shard_rows(dim0: int, rank: int, world_size: int) -> int:
    """Rows of a dim-0 shard, as torch.chunk splits them (the last ranks may get fewer)."""
    chunk = math.ceil(dim0 / world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


@dataclass
class FSDPConfig(StrategyConfig):
    name: str = "fsdp"
    reshard_after_forward: bool = True
    """Free gathered parameters after forward and gather again in backward (ZeRO-3)."""


@dataclass
class FSDPGradOpConfig(FSDPConfig):
    name: str = "fsdp_grad_op"
    reshard_after_forward: bool = False
    """Keep gathered parameters from forward to backward (ZeRO-2-like)."""


@STRATEGIES.register("fsdp")
class FSDP(Strategy):
    Config = FSDPConfig
    shards_parameters = True
    grads_differ_across_ranks = True  # sharded gradients: the scaler agrees on inf/nan

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        with unset_fake_temporarily():  # a mesh is bookkeeping: real even in a fake step
            mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        half = precision.compute_dtype(precision_cfg.name)
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
        for block in units(module):
            fully_shard(block, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
        # fully_shard replaced the parameters by DTensors: group and build the optimizer now.
        return cls(module, module, optim_spec.regroup(module).build(), precision_cfg, device)

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

    def inject_inf_grad(self):
        # Sharded parameters never see autograd: hook the gathered weight of the first layer
        # during its forward, and poison only the rows of this rank's own dim-0 shard.
        layer = next(m for m in self.module.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

        def poison(grad):
            chunk = math.ceil(grad.shape[0] / world_size)
            grad = grad.clone()
            grad[rank * chunk : (rank + 1) * chunk] = float("inf")
            return grad

        handles = []

        def pre_forward(mod, args):
            handles.append(mod.weight.register_hook(poison))

        handles.append(layer.register_forward_pre_hook(pre_forward))

        class Handle:
            def remove(self):
                for h in handles:
                    h.remove()

        return Handle()

    # ----------------------------------------------------------------- memory model
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
        rows = [_shard_rows(s[0], rank, world_size) * math.prod(s[1:]) for s in shapes]
        # Sharded parameters and gradients live in storage padded to equal dim-0 chunks on
        # every rank; optimizer state is allocated like the unpadded local shard.
        padded = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)
        return {"params": padded, "grads": padded, "optimizer": rows}


@STRATEGIES.register("fsdp_grad_op")
class FSDPGradOp(FSDP):
    Config = FSDPGradOpConfig
