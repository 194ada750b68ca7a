"""ddp: torch DistributedDataParallel. Nothing sharded; the baseline of every comparison.

Every rank holds parameters, gradients and optimizer state in full; gradients are
all-reduced in buckets during backward.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sharded_exp.config import bounded
from sharded_exp.measure.tracker import communication_buffers, reallocated
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
        _for_fake_step(model, cfg.find_unused_parameters)
    else:
        model.reducer = _Reducer(model.reducer)
    return model


class _Reducer:
    """DDP's reducer, whose bucket rebuild (before the second forward, in the order the
    first backward made the gradients) allocates memory that the CPU tracker files as the
    communication buckets it is (``communication_buffers``), not as activations. Under a
    fake process group (``fake``) the reducer keeps its first buckets: the rebuild agrees on
    new ones by exchanging values, which a fake group does not have. The rebuild's memory is
    told to whoever watches the fake step's allocations instead (:class:`_FakeRebuild`)."""

    def __init__(self, reducer, fake: "_FakeRebuild | None" = None):
        self._reducer = reducer
        self._fake = fake

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        if self._fake is not None:
            self._fake.rebuild()
            return False
        with communication_buffers():
            return self._reducer._rebuild_buckets()


class _FakeRebuild:
    """DDP's bucket rebuild as the allocator sees it, in a fake step.

    Until its first rebuild DDP holds every gradient in one bucket (torch 2.11 and 2.13: the
    first iteration's order may not be the backward's, so it does not bucket); before the
    second forward it makes new buckets of ``bucket_cap_mb`` in the order the first synced
    backward made the gradients, and drops the old one. The same bytes in other blocks: what
    a caching allocator then caches differs (torch's ``Reducer::rebuild_buckets`` and
    ``initialize_buckets``). Here the order is read from the backward (a hook per parameter),
    the first bucket from the gradient hook, the new sizes from torch's own assignment
    (``dist._compute_bucket_assignment_by_size``), and :func:`reallocated` tells the fake
    step's allocator trace. Not with ``find_unused_parameters``: DDP then never rebuilds, but
    makes buckets of ``bucket_cap_mb`` from the start, which the fake DDP (built without it)
    does not; its one bucket is kept. Not modelled either: ``DDP_SET_LAST_BUCKET_CAP``, per-bucket
    caps (``bucket_cap_mb_list``, which this project does not pass), and the small tensors
    the rebuild syncs its order through."""

    def __init__(self, model: DistributedDataParallel, rebuilds: bool):
        # what the rebuild needs of the model, not the model: the gradient hook that calls
        # this is held by the C++ reducer, where a reference back to the model is a cycle
        # the garbage collector cannot see
        self.as_view = bool(model.gradient_as_bucket_view)
        self.limits = _rebuild_limits(model)
        self.order: list[torch.nn.Parameter] = []
        self._ordered: set[int] = set()
        self.buffers: dict[int, torch.Tensor] = {}  # the first buckets (by index), seen in a synced backward
        self.params: list[torch.nn.Parameter] = []  # in the buckets, as DDP manages them
        self.done = not rebuilds
        seen: set[int] = set()
        self._hooks = []
        for p in model.module.parameters() if rebuilds else ():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))

    def _ready(self, param) -> None:
        if id(param) not in self._ordered:
            self._ordered.add(id(param))
            self.order.append(param)

    def bucket_reduced(self, bucket) -> None:
        """The gradient hook's bucket (a synced backward)."""
        if not self.done and bucket.index() not in self.buffers:
            self.buffers[bucket.index()] = bucket.buffer()
            self.params += bucket.parameters()

    def rebuild(self) -> None:
        """Before a forward: the first time after a synced backward, the rebuild's blocks."""
        if self.done:
            return
        if not self.buffers:  # no synced backward yet (no_sync's micro-steps): DDP keeps its order from that one
            self.order, self._ordered = [], set()
            return
        self.done = True
        for h in self._hooks:
            h.remove()
        managed = self.params
        old = [self.buffers[k] for k in sorted(self.buffers)]
        sizes = self._rebuilt_sizes(managed)
        self.buffers, self.params, self.order, self._ordered = {}, [], [], set()
        # gradients that are views into the old buckets are copied into the new ones first
        views = self.as_view and any(p.grad is not None for p in managed)
        if sizes is None or (not views and sizes == [t.untyped_storage().nbytes() for t in old]):
            return  # one bucket again, as big and freed first: the allocator hands back the block just freed
        reallocated(old, sizes, old_freed_last=views)

    def _rebuilt_sizes(self, managed: list) -> list[int] | None:
        """The new buckets' bytes, in the order they are made (torch's assignment over the
        gradients in the order they were ready, as ``Reducer::rebuild_buckets`` passes them:
        unsorted); None where the order does not hold every managed parameter."""
        ids = {id(p) for p in managed}
        ready = [p for p in self.order if id(p) in ids]
        if len(ready) != len(ids):
            return None  # a hook that never fired: nothing told rather than a wrong bucket
        indices, _ = dist._compute_bucket_assignment_by_size(
            ready, self.limits, [False] * len(ready), list(range(len(ready)))
        )
        return [sum(ready[i].numel() * ready[i].element_size() for i in b) for b in indices]


def _rebuild_limits(model: DistributedDataParallel) -> list[int]:
    """The bucket sizes DDP's rebuild fills to: its first bucket's cap, then ``bucket_cap_mb``
    (torch 2.13 keeps them in ``_bucket_config``; 2.11 on the module, the first 1 MiB
    unless ``bucket_cap_mb`` was given)."""
    config = getattr(model, "_bucket_config", None)
    if config is not None:
        return [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    default = getattr(model, "bucket_bytes_cap_default", False)
    return [dist._DEFAULT_FIRST_BUCKET_BYTES if default else model.bucket_bytes_cap, model.bucket_bytes_cap]


def _for_fake_step(model: DistributedDataParallel, find_unused_parameters: bool) -> None:
    """Under a fake process group, the gradient all-reduce becomes the identity on each
    bucket (in place, as the real one) and the bucket rebuild is told, not made."""
    fake = _FakeRebuild(model, rebuilds=not find_unused_parameters)

    def identity(state, bucket):
        fake.bucket_reduced(bucket)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, identity)
    model.reducer = _Reducer(model.reducer, fake)


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

    tensors_by_world_size = False

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
