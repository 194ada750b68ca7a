"""Deliberately broken strategies, loaded with SHARDED_EXP_PLUGINS=tests.helpers.broken_strategies.

They show that the tests can fail: each is a real strategy with one known mistake.
"""

from dataclasses import dataclass

from sharded_exp import precision
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.sharded_ddp import ShardedDDP, ShardedDDPConfig


@dataclass
class SetToNoneConfig(ShardedDDPConfig):
    name: str = "sharded_ddp_set_to_none"


@STRATEGIES.register("sharded_ddp_set_to_none")
class SetToNoneShardedDDP(ShardedDDP):
    Config = SetToNoneConfig

    def zero_grad(self) -> None:
        # torch's default since 2.0 (set_to_none=True): silently wrong under ShardedDDP.
        self.optimizer.zero_grad()


@dataclass
class PlainScalerConfig(ShardedDDPConfig):
    name: str = "sharded_ddp_plain_scaler"


@STRATEGIES.register("sharded_ddp_plain_scaler")
class PlainScalerShardedDDP(ShardedDDP):
    Config = PlainScalerConfig

    def __init__(self, model, module, optimizer, precision_cfg, device):
        super().__init__(model, module, optimizer, precision_cfg, device)
        # A per-rank found-inf decision: ranks can disagree on whether to skip the step.
        self.scaler = precision.grad_scaler(precision_cfg, device.type, sharded_grads=False)
