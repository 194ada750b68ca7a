"""oss: fairscale OSS under torch DDP (ZeRO stage 1: optimizer state sharded).

Gradients are all-reduced in full by DDP; each rank then steps only the parameters of its
own shard (OSS partitions greedily by size, so shards are close to, not exactly, 1/N)
and broadcasts the updated parameters to the others.

Warning:
    fairscale is unmaintained (last release 0.4.13, Dec 2022). OSS + DDP has been checked
    against DDP on torch 2.x (tests/test_parity.py); re-run that test after upgrading torch.
"""

import math
from dataclasses import dataclass

from fairscale.optim import OSS

from sharded_exp import precision
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import Strategy
from sharded_exp.strategies.ddp import DDPConfig, wrap_ddp


@dataclass
class OSSConfig(DDPConfig):
    name: str = "oss"
    broadcast_fp16: bool = False
    """Send parameters as fp16 in OSS's post-step broadcast (fairscale default off; lossy)."""

    @staticmethod
    def resident_numel(cfg, shapes, owners, rank, world_size):
        # ZeRO-1: only the optimizer state of the rank's own shard
        numels = [math.prod(s) for s in shapes]
        return {"params": sum(numels), "grads": sum(numels), "optimizer": owned(numels, owners, rank)}


def owned(numels, owners, rank):
    return [n for n, o in zip(numels, owners) if o == rank]


class OSSStrategy(Strategy):
    optimizer_state_sharded = True

    def clip_grad_norm_(self, max_norm: float):
        # OSS computes the norm over its shard and all-reduces it: the global norm.
        return self.optimizer.clip_grad_norm(max_norm)

    def local_optimizers(self) -> list:
        return [self.optimizer.optim]  # OSS wraps one optimizer built over this rank's shard

    def local_shard(self) -> list:
        return [p for group in self.optimizer.partition_parameters()[self.optimizer.rank] for p in group["params"]]


def make_oss(spec, broadcast_fp16: bool) -> OSS:
    return OSS(spec.param_groups, optim=spec.cls, broadcast_fp16=broadcast_fp16, **spec.defaults)


@STRATEGIES.register("oss", config=OSSConfig)
def build(cfg: OSSConfig, module, optim_spec, precision_cfg, device) -> Strategy:
    model = wrap_ddp(cfg, module, device)
    optimizer = make_oss(optim_spec, cfg.broadcast_fp16)
    # Only the shard's gradients are unscaled and checked on each rank: the found-inf
    # flag must be agreed across ranks.
    scaler = precision.grad_scaler(precision_cfg, device.type, sharded_grads=True)
    return OSSStrategy(model, module, optimizer, scaler)
