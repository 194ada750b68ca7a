"""sharded_ddp: fairscale OSS + ShardedDataParallel (ZeRO stage 2: optimizer state and
gradients sharded).

Each gradient is reduced (not all-reduced) to the rank that owns its optimizer shard;
the other ranks drop it. After the step, OSS broadcasts the updated parameters.

Warning:
    With reduce buckets on (fairscale's default ``reduce_buffer_size=2**23``), clearing
    gradients with ``set_to_none=True`` -- what ``optimizer.zero_grad()`` does by default
    since torch 2.0 -- makes ShardedDataParallel compute wrong gradients from the second
    step on, silently. This strategy therefore zeroes gradients in place through
    ``ShardedDataParallel.zero_grad``, which also clears its buckets, whatever
    ``trainer.zero_grad`` asks: ``free`` is not honoured here, and result.json's
    ``zero_grad`` says so (requested free, applied zeros, and why). The parity test against
    DDP (tests/integration/test_parity.py) fails if that is changed.

Warning:
    fairscale is unmaintained (last release 0.4.13, Dec 2022).
"""

import math
from dataclasses import dataclass

from sharded_exp.config import ZeroGrad, bounded
from sharded_exp.measure.tracker import communication_buffers
from sharded_exp.strategies import STRATEGIES
from sharded_exp.strategies.base import StrategyConfig
from sharded_exp.strategies.oss import OSS, OSSMemory, make_oss
from sharded_exp.strategies.timing import ShardedDDPTime
from sharded_exp.strategies.traits import Traits


@dataclass
class ShardedDDPConfig(StrategyConfig):
    REQUIRES = ("fairscale",)
    """The packages this strategy needs beyond torch (:func:`sharded_exp.config.check_packages`)."""
    name: str = "sharded_ddp"
    reduce_buffer_size: int = bounded(2**23, at_least=0)
    """Elements per gradient reduce bucket; 0 turns buckets off (fairscale default 2**23)."""
    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 at every forward (fairscale default on)."""
    broadcast_fp16: bool = False
    """Send parameters as fp16 in OSS's post-step broadcast (fairscale default off; lossy)."""


def bucketed(reduce_buffer_size, numels, owners, world_size) -> list[bool]:
    """Which parameters' gradients live in a reduce bucket, as ShardedDataParallel fills
    them: one bucket per destination rank of ``min(reduce_buffer_size, trainable elements)``
    places (all allocated at once when the buckets are set up: a transient of world_size of
    them), filled with the smallest parameters first, each bucket then shrunk to its fill."""
    if world_size == 1:
        return [False] * len(numels)
    capacity = min(reduce_buffer_size, sum(numels))
    # fairscale orders parameters by owner, then (stable) by size, before filling buckets:
    # by size, then owner, then position
    order = sorted(range(len(owners)), key=lambda i: (numels[i], owners[i], i))
    fill = [0] * world_size
    out = [False] * len(numels)
    for i in order:
        dst = owners[i]
        if capacity > 0 and fill[dst] + numels[i] < capacity:
            fill[dst] += numels[i]
            out[i] = True
    return out


def resident_grad_numel(reduce_buffer_size, numels, owners, rank, world_size) -> int:
    """Gradient elements a rank keeps under ShardedDataParallel, following its bucketing.

    Gradients of parameters that fit in a reduce bucket live in that bucket, and every
    rank keeps every destination's bucket; only the others are truly sharded (dropped by
    non-owners after the reduce). So with the default 2**23-element buckets, models below
    about 8M parameters per rank get no gradient saving at all.
    """
    if world_size == 1:
        return sum(numels)
    # bucketed: resident on every rank; unbucketed: kept by its owner only
    in_bucket = bucketed(reduce_buffer_size, numels, owners, world_size)
    return sum(n for n, b, o in zip(numels, in_bucket, owners) if b or o == rank)


class ShardedDDPMemory(OSSMemory):
    """OSS's, with ShardedDataParallel's reduce buckets: a gradient is kept by its owner only
    unless it lives in a bucket, which every rank keeps."""

    # How many reduce buckets there are, and how full, depends on the world size and the
    # depth: the planner checks its lines at every world size (and see setup_transient_mib).
    depth_lines_per_world_size = True

    # In the words of bucket_numel and setup_transient_mib below.
    peak_grows_with_ranks = (
        "fairscale's ShardedDataParallel keeps one gradient reduce bucket per rank on every rank "
        "(up to strategy.reduce_buffer_size elements each, filled with the smallest gradients), "
        "so each added rank adds a bucket that every rank holds"
    )

    @classmethod
    def setup_transient_mib(cls, cfg, shapes, world_size: int) -> float:
        # Setting up its buckets, ShardedDataParallel allocates one bucket of
        # min(reduce_buffer_size, model size) per destination rank that owns a trainable
        # parameter, all at once, before shrinking each to its fill.
        if world_size == 1 or not cfg.reduce_buffer_size:
            return 0.0
        numels = [[math.prod(s) for s in g] for g in shapes.groups]
        destinations = len(set(cls.partition(numels, world_size)))
        return destinations * min(cfg.reduce_buffer_size, shapes.params) * shapes.element_bytes / 2**20

    @classmethod
    def bucket_numel(cls, cfg, numels, owners, rank, world_size):
        # Every rank keeps every destination's bucket; the bucketed gradients are views into them.
        held = sum(n for n, b in zip(numels, bucketed(cfg.reduce_buffer_size, numels, owners, world_size)) if b)
        return held, held

    @classmethod
    def resident_numel(cls, cfg, shapes, owners, rank, world_size):
        held = super().resident_numel(cfg, shapes, owners, rank, world_size)
        numels = [math.prod(s) for s in shapes]
        return {**held, "grads": resident_grad_numel(cfg.reduce_buffer_size, numels, owners, rank, world_size)}


@STRATEGIES.register("sharded_ddp")
class ShardedDDP(OSS):
    Config = ShardedDDPConfig
    traits = Traits(
        sharding=2,
        optimizer_state_sharded=True,
        requires=ShardedDDPConfig.REQUIRES,
        wrappers=("fairscale.nn.data_parallel.ShardedDataParallel",),
        clip_reads_values=True,  # OSS.clip_grad_norm: ``if clip_coef < 1``
        grads_differ_across_ranks=True,  # sharded gradients: the scaler agrees on inf/nan
        zero_grad_fixed=ZeroGrad.zeros,
        zero_grad_fixed_reason=(
            "sharded_ddp zeroes gradients in place: fairscale ShardedDataParallel computes wrong gradients "
            "from the second step on when they are freed (set_to_none=True)"
        ),
    )
    memory = ShardedDDPMemory
    timing = ShardedDDPTime

    @classmethod
    def build(cls, cfg, module, optim_spec, precision_cfg, device):
        from fairscale.nn.data_parallel import ShardedDataParallel  # lazy: fairscale is optional (REQUIRES)

        optimizer = make_oss(optim_spec, cfg.broadcast_fp16)
        model = ShardedDataParallel(
            module, optimizer, reduce_buffer_size=cfg.reduce_buffer_size, broadcast_buffers=cfg.broadcast_buffers
        )
        # Its reduce buckets are (re)made at the first forward, and whenever which parameters
        # train changes: filed as the communication buckets they are.
        setup = model._setup_bucket_strategy

        def setup_buckets() -> None:
            with communication_buffers():
                setup()

        model._setup_bucket_strategy = setup_buckets
        return cls(model, module, optimizer, precision_cfg, device)

    def zero_grad(self) -> None:
        # Never set_to_none here: see the module's warning.
        self.model.zero_grad(set_to_none=False)
