"""oss: fairscale OSS under torch DDP (ZeRO stage 1: optimizer state sharded).

Gradients are all-reduced in full by DDP; each rank then steps only the parameters of its
own shard (OSS partitions greedily by size, so shards are close to, not exactly, 1/N)
and broadcasts the updated parameters to the others.

Warning:
    fairscale is unmaintained (last release 0.4.13, Dec 2022). OSS + DDP has been checked
    against DDP on torch 2.x (tests/integration/test_parity.py); re-run that test after upgrading torch.
    fairscale is imported only when the strategy is built: the other strategies run
    without it installed.
"""

from dataclasses import dataclass

from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.ddp import DDP, DDPConfig, DDPMemory, wrap_ddp
from sharded_exp.strategies.timing import OSSTime
from sharded_exp.strategies.traits import Traits


@dataclass
class OSSConfig(DDPConfig):
    REQUIRES = ("fairscale",)
    """The packages this strategy needs beyond torch (:func:`sharded_exp.config.check_packages`)."""
    name: str = "oss"
    broadcast_fp16: bool = False
    """Send parameters as fp16 in OSS's post-step broadcast (fairscale default off; lossy)."""


def make_oss(spec, broadcast_fp16: bool):
    from fairscale.optim import OSS  # lazy: fairscale is optional (REQUIRES)

    return OSS(spec.param_groups, optim=spec.cls, broadcast_fp16=broadcast_fp16, **spec.defaults)


class OSSMemory(DDPMemory):
    """DDP's, but each rank keeps the optimizer state of the parameters it owns only (ZeRO-1)."""

    tensors_by_world_size = True  # which parameters a rank owns moves with the world size

    @classmethod
    def optimizer_numels(cls, numels, owners, rank):
        return cls.owned(numels, owners, rank)


@STRATEGIES.register("oss")
class OSS(DDP):
    Config = OSSConfig
    traits = Traits(
        sharding=1,
        optimizer_state_sharded=True,
        requires=OSSConfig.REQUIRES,
        wrappers=("fairscale.optim.OSS",),
        clip_reads_values=True,  # OSS.clip_grad_norm: ``if clip_coef < 1``
        # Only the shard's gradients are unscaled and checked on each rank: the found-inf
        # flag must be agreed across ranks.
        grads_differ_across_ranks=True,
    )
    memory = OSSMemory
    timing = OSSTime

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        model = wrap_ddp(cfg, module, device)
        return cls(model, module, make_oss(optim_spec, cfg.broadcast_fp16), precision_cfg, device)

    def clip_grad_norm_(self, max_norm: float):
        # OSS computes the norm over its shard and all-reduces it: the global norm.
        return self.optimizer.clip_grad_norm(max_norm)

    def local_optimizers(self) -> list:
        return [self.optimizer.optim]  # OSS wraps one optimizer built over this rank's shard

    def local_shard(self) -> list:
        return [p for group in self.optimizer.partition_parameters()[self.optimizer.rank] for p in group["params"]]
