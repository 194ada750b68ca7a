"""strategies/ddp.py: DDP's memory model (every state in full, one bucket place per trainable
element, gradients as views of it or not) and its wrapping under a fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.strategies.ddp import DDP, DDPConfig, _Reducer, wrap_ddp


def _cfg(**kw):
    return OmegaConf.structured(DDPConfig(**kw))


def test_ddp_holds_full_params_grads_and_optimizer_state_on_every_rank_as_4_bytes_each():
    shapes = [(64, 32), (32,), (10, 64)]
    numels = [2048, 32, 640]
    for rank in range(4):
        held = DDP.memory.resident_numel(_cfg(), shapes, DDP.memory.partition([numels], 4), rank, 4)
        assert held["params"] * 4 == held["grads"] * 4 == sum(numels) * 4 == 10880
        assert held["optimizer"] == numels


@pytest.mark.parametrize("as_view", [False, True])
def test_the_buckets_hold_every_trainable_element_and_alias_the_grads_only_as_views(as_view):
    held, aliased = DDP.memory.bucket_numel(_cfg(gradient_as_bucket_view=as_view), [100, 10, 1], [0, 0, 0], 1, 4)
    assert held == 111 and aliased == (111 if as_view else 0)


def test_ddp_shards_nothing_and_gathers_nothing():
    assert DDP.traits.sharding == 0 and DDP.traits.checkpoint_format_auto == "consolidated"
    assert DDP.traits.optimizer_state_sharded is False and DDP.traits.grads_differ_across_ranks is False
    assert DDP.memory.transient_param_numel(_cfg(), [5, 5], 3, 2) == 0


def test_under_a_fake_group_ddp_keeps_its_first_bucket_order(fake_group):
    fake_group(4, rank=3)
    model = wrap_ddp(_cfg(find_unused_parameters=True, bucket_cap_mb=1.0), nn.Linear(4, 2), torch.device("cpu"))
    assert isinstance(model.reducer, _Reducer) and model.reducer._rebuild_buckets() is False
    assert model.reducer._fake.done  # asked for find_unused_parameters, DDP never rebuilds: nothing to tell
    assert model.find_unused_parameters is False  # its search reads values a fake step has not
    assert dist.get_world_size() == 4


def test_under_a_real_group_ddp_keeps_the_asked_settings_and_rebuilds_its_buckets(gloo_group):
    model = wrap_ddp(_cfg(find_unused_parameters=True, gradient_as_bucket_view=True, broadcast_buffers=False),
                     nn.Linear(4, 2), torch.device("cpu"))  # fmt: skip
    assert model.find_unused_parameters is True and model.gradient_as_bucket_view is True
    assert model.broadcast_buffers is False
    assert isinstance(model.reducer, _Reducer) and model.reducer._fake is None


def test_the_reducer_wrapper_passes_every_other_attribute_through():
    class Inner:
        answer = 42

        def _rebuild_buckets(self):
            return True

    class Told:
        asked = 0

        def rebuild(self):
            self.asked += 1

    told = Told()
    assert _Reducer(Inner()).answer == 42 and _Reducer(Inner())._rebuild_buckets() is True
    assert _Reducer(Inner(), told)._rebuild_buckets() is False and told.asked == 1


class _Stack(nn.Module):
    """Layers of unequal sizes, so that buckets of 1 MB close at different places in the
    forward's and the backward's order; ``head`` is used first though defined last."""

    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(256, 512), nn.Linear(512, 256), nn.Linear(256, 1024), nn.Linear(1024, 8)])
        self.head = nn.Linear(8, 256)

    def forward(self, x):
        x = self.head(x)
        for layer in self.body:
            x = torch.relu(layer(x))
        return x.sum()


def _two_steps(model, x, free_grads: bool = False) -> None:
    model(x).backward()
    if free_grads:  # zero_grad(set_to_none=True) between the steps
        for p in model.parameters():
            p.grad = None
    model(x).backward()  # DDP rebuilds at the start of this, the second forward
    model(x)


@pytest.mark.parametrize("as_view,free_grads", [(False, False), (True, False), (True, True)])
def test_a_fake_step_tells_the_buckets_real_ddp_rebuilds(gloo_group, as_view, free_grads):
    """Real DDP (gloo, one rank) rebuilds its one first bucket into buckets of bucket_cap_mb in
    the backward's order (the first as big as the rest: this project passes bucket_cap_mb);
    under a fake group the same model tells those sizes, in that order, with the first bucket
    as the old one, freed first unless gradients still view it."""
    from sharded_exp.strategies.ddp import _rebuild_limits

    torch.manual_seed(0)
    cap = 0.5  # not torch's 1 MiB first bucket, which a bucket_cap_mb of 1 would hide
    cfg, x = _cfg(bucket_cap_mb=cap, gradient_as_bucket_view=as_view), torch.randn(4, 8)
    real = wrap_ddp(cfg, _Stack(), torch.device("cpu"))
    assert _rebuild_limits(real) == [int(cap * 2**20)] * 2
    _two_steps(real, x, free_grads)
    logged = real._get_ddp_logging_data()
    first = [int(n) for n in str(logged["bucket_sizes"]).split(", ")]
    rebuilt = [int(n) for n in str(logged["rebuilt_bucket_sizes"]).split(", ")]
    assert len(first) == 1 and len(rebuilt) > 2 and sum(rebuilt) == sum(first)

    dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from sharded_exp.measure.tracker import watching_reallocations

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    told = []
    fake = wrap_ddp(cfg, _Stack(), torch.device("cpu"))
    with watching_reallocations(lambda old, sizes, last: told.append(([t.nbytes for t in old], sizes, last))):
        _two_steps(fake, x, free_grads)
        fake(x)  # once only
    assert told == [(first, rebuilt, as_view and not free_grads)]


@pytest.mark.parametrize("as_view", [False, True])
def test_a_rebuild_into_one_bucket_as_big_is_told_only_where_gradients_view_it(fake_group, as_view):
    """Every gradient within one bucket_cap_mb: the rebuild makes one bucket of the same bytes.
    Freed first, the allocator serves it from the block just freed: not told. Where the
    gradients are views into the old bucket they are copied over first: both are held."""
    from sharded_exp.measure.tracker import watching_reallocations

    fake_group(2)
    told = []
    model = wrap_ddp(_cfg(bucket_cap_mb=25.0, gradient_as_bucket_view=as_view), _Stack(), torch.device("cpu"))
    with watching_reallocations(lambda old, sizes, last: told.append((len(old), len(sizes), last))):
        _two_steps(model, torch.randn(4, 8))
    assert told == ([(1, 1, True)] if as_view else []) and model.reducer._fake.done


def test_ddps_bucket_rule_holds_every_trainable_gradient_and_aliases_them_only_as_views():
    """The one bucket rule, in any unit: the prediction's elements and the probe's MiB."""
    from sharded_exp.strategies.ddp import DDPMemory

    assert DDPMemory.buckets(3.5, False) == (3.5, 0) and DDPMemory.buckets(3.5, True) == (3.5, 3.5)
    assert DDP.memory is DDPMemory and DDP.traits.baseline and DDP.traits.sharding == 0
