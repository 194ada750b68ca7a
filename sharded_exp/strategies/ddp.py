"""ddp: torch DistributedDataParallel. Nothing sharded; the baseline of every comparison.

Every rank holds parameters, gradients and optimizer state in full; gradients are
all-reduced in buckets during backward.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sharded_exp.config import bounded
from sharded_exp.measure.tracker import communication_buffers
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import Strategy, StrategyConfig
from sharded_exp.strategies.residency import MemoryModel
from sharded_exp.strategies.traits import Traits


def wrap_ddp(cfg, module, device) -> DistributedDataParallel:
    """``module`` under torch DDP with the knobs of :class:`DDPConfig` (also used by the
    ZeRO-1 strategies, which run under DDP)."""
    kwargs = {}
    fake = dist.get_backend() == "fake"  # the planner's fake step (sharded_exp.predict.fake_step)
    if cfg.find_unused_parameters and not fake:
        # Its search reads which parameters got gradients, a value fake tensors do not have;
        # the fake step's identity all-reduce (below) needs no search, and memory is the same.
        kwargs["find_unused_parameters"] = True
    if not cfg.broadcast_buffers:
        # Passed only when changed: torch >= 2.13 warns that the name is deprecated.
        kwargs["broadcast_buffers"] = False
    model = DistributedDataParallel(
        module,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        init_sync=not fake,  # its checks read tensor values, which fake tensors do not have
        **kwargs,
    )
    if fake:
        _for_fake_step(model)
    else:
        model.reducer = _Reducer(model.reducer)
    return model


class _Reducer:
    """DDP's reducer, whose bucket rebuild (before the second forward, in the order the
    first backward made the gradients) allocates memory that the CPU tracker files as the
    communication buckets it is (``communication_buffers``), not as activations. Under a
    fake process group (``rebuild=False``) the first bucket order is kept: the rebuild
    agrees on a new one by exchanging values, which a fake group cannot (same sizes)."""

    def __init__(self, reducer, rebuild: bool = True):
        self._reducer = reducer
        self._rebuild = rebuild

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        if not self._rebuild:
            return False
        with communication_buffers():
            return self._reducer._rebuild_buckets()


def _for_fake_step(model: DistributedDataParallel) -> None:
    """Under a fake process group, the gradient all-reduce becomes the identity on each
    bucket (in place, as the real one) and buckets are not rebuilt."""

    def identity(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, identity)
    model.reducer = _Reducer(model.reducer, rebuild=False)


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    bucket_cap_mb: float = bounded(25.0, at_least=0)
    """Gradient all-reduce bucket size in MB (torch default 25)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the bucket memory, saving one gradient-sized copy (torch default off)."""
    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 at every forward (torch default on)."""
    find_unused_parameters: bool = False
    """Let parameters that get no gradient in a step (a branch the forward skips) be
    found and left out of the all-reduce; costs a graph walk each step (torch default off)."""


class DDPMemory(MemoryModel):
    """Every state whole on every rank, and every gradient's place in an all-reduce bucket."""

    @staticmethod
    def buckets(trainable: float, gradient_as_bucket_view: bool) -> tuple[float, float]:
        """DDP's bucket rule: (how much its all-reduce buckets hold, how much of that is also
        the gradients), for ``trainable`` gradient elements (or bytes, or MiB). Every
        trainable parameter's gradient has a place in one bucket (DDP's reducer;
        bucket_cap_mb only decides how many buckets); with gradient_as_bucket_view the
        gradients are those places."""
        return trainable, trainable if gradient_as_bucket_view else 0

    @classmethod
    def bucket_numel(cls, cfg, numels, owners, rank, world_size):
        return cls.buckets(sum(numels), cfg.gradient_as_bucket_view)


@STRATEGIES.register("ddp")
class DDP(Strategy):
    Config = DDPConfig
    # Gradients are identical on every rank after the all-reduce: a plain scaler agrees.
    traits = Traits(
        sharding=0,
        baseline=True,
        wrappers=(
            "torch.nn.parallel.DistributedDataParallel",
            "torch.distributed.fsdp.FullyShardedDataParallel:NO_SHARD",
        ),
    )
    memory = DDPMemory

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        return cls(wrap_ddp(cfg, module, device), module, optim_spec.build(), precision_cfg, device)
