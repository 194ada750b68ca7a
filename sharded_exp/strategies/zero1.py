"""zero1: torch ZeroRedundancyOptimizer under DDP (ZeRO stage 1: optimizer state sharded).

PyTorch's native counterpart of fairscale OSS, and needs no fairscale. Gradients are
all-reduced in full by DDP; each rank steps the parameters of its shard and broadcasts
them. Its partition is greedy too, but it visits each parameter group's tensors largest
first.
"""

from dataclasses import dataclass

import torch

from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.ddp import DDP, DDPConfig, wrap_ddp
from sharded_exp.strategies.oss import OSSMemory
from sharded_exp.strategies.residency import greedy_partition
from sharded_exp.strategies.timing import ZeRO1Time
from sharded_exp.strategies.traits import Traits


@dataclass
class ZeRO1Config(DDPConfig):
    name: str = "zero1"
    parameters_as_bucket_view: bool = False
    """Pack each rank's parameters into one flat buffer for the broadcast (torch default off)."""


class ZeRO1Memory(OSSMemory):
    """OSS's, with ZeroRedundancyOptimizer's partition."""

    @staticmethod
    def partition(group_numels, world_size):
        # ZeroRedundancyOptimizer sorts each group by size, largest first, then goes greedy.
        return greedy_partition(group_numels, world_size, largest_first=True)


@STRATEGIES.register("zero1")
class ZeRO1(DDP):
    Config = ZeRO1Config
    traits = Traits(
        sharding=1,
        optimizer_state_sharded=True,
        wrappers=("torch.distributed.optim.ZeroRedundancyOptimizer",),
        grads_differ_across_ranks=True,  # each rank unscales and checks its own shard only
    )
    memory = ZeRO1Memory
    timing = ZeRO1Time

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        # torch.distributed.optim scripts its functional optimizers on import (0.2 s of CPU),
        # which the job's parent, importing every strategy for its schema, never needs
        from torch.distributed.optim import ZeroRedundancyOptimizer  # lazy: 0.2 s, see above

        model = wrap_ddp(cfg, module, device)
        optimizer = ZeroRedundancyOptimizer(
            optim_spec.param_groups,
            optimizer_class=optim_spec.cls,
            parameters_as_bucket_view=cfg.parameters_as_bucket_view,
            **optim_spec.defaults,
        )
        return cls(model, module, optimizer, precision_cfg, device)

    def clip_grad_norm_(self, max_norm: float):
        # Gradients are complete on every rank after DDP's all-reduce: the plain global norm.
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def local_optimizers(self) -> list:
        return [self.optimizer.optim]

    def local_shard(self) -> list:
        return [p for group in self.optimizer._partition_parameters()[self.optimizer.rank] for p in group["params"]]
