"""probe/fsdp2.py: the fake step of a model the user sharded with FSDP2, on a copy sharded
again the same way. In this process, on a fake default process group of 2 ranks (the user's
model is sharded on it; its collectives do nothing), beside which the copy's own is made."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from sharded_exp.probe import fake, fsdp2

MIB = 2**20


@pytest.fixture
def two_ranks():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale


def _sharded(**settings) -> Net:
    torch.manual_seed(0)
    net = Net()
    for layer in (net.inp, net.mid):
        fully_shard(layer, **settings)
    fully_shard(net)  # the root takes `out` and the buffer's module
    return net


def _step(module, batch):
    return nn.functional.cross_entropy(module(batch[0]), batch[1])


def test_the_copy_is_whole_fake_of_the_users_classes_and_without_fsdp(two_ranks):
    net = _sharded()
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        copy = fsdp2.unsharded_copy(net)
    assert type(copy) is Net and type(copy.inp) is nn.Linear and not fsdp2.is_fsdp2(copy)
    assert copy.inp.weight.shape == (64, 16) and isinstance(copy.inp.weight, FakeTensor)
    assert not isinstance(copy.inp.weight, DTensor) and isinstance(copy.scale, FakeTensor)
    assert not copy._forward_pre_hooks and not copy.inp._forward_hooks  # FSDP's hooks stay with the user's
    assert isinstance(net.inp, FSDPModule) and isinstance(net.inp.weight, DTensor)  # the user's untouched
    assert [name for name, _ in fsdp2.units(net)] == ["mid", "inp", ""]  # children first


def test_the_fake_step_holds_half_the_parameters_at_two_ranks_and_leaves_the_groups_as_they_were(two_ranks):
    net = _sharded()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    before = [p.to_local().clone() for p in net.parameters()]
    groups, count = dict(c10d._world.pg_names), c10d._world.group_count
    got = fake.predict_peak(net, optimizer, (torch.zeros(8, 16), torch.zeros(8, dtype=torch.int64)), _step)
    assert got["error"] is None and "FSDP2" in got["method"], got
    whole = sum(p.numel() * 4 for p in Net().parameters()) / MIB
    parts = got["breakdown_mib"]
    # this rank's shards (and, at the peak, the root's own parameters gathered: the root keeps
    # them gathered from its forward to its backward, and they are the module's parameters then)
    assert whole / 2 <= parts["params"] < whole * 0.6
    assert parts["optimizer"] == pytest.approx(whole, rel=0.02)  # Adam's two states of the shards
    assert got["peak_mib"] > whole / 2 + whole
    assert dict(c10d._world.pg_names) == groups and c10d._world.group_count == count
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, net.parameters()))


def test_each_units_settings_are_kept(two_ranks):
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    net = _sharded(mp_policy=bf16, reshard_after_forward=False)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        copy = fsdp2.unsharded_copy(net)
        fsdp2.shard_like(copy, net, mesh)
    group = copy.mid._get_fsdp_state()._fsdp_param_group
    assert group.mp_policy.param_dtype == torch.bfloat16 and group.post_forward_mesh_info is None
    assert copy.out.weight.to_local().shape == (2, 64)  # sharded along dim 0 over 2 ranks


def test_parameters_kept_out_of_fsdp2_are_said_not_guessed(two_ranks):
    torch.manual_seed(0)
    net = Net()
    fully_shard(net, ignored_params={net.out.bias})
    why = fsdp2.refusal(net)
    assert "kept out of FSDP2 (out.bias)" in why
    got = fake.predict_peak(net, torch.optim.SGD(net.parameters()), (torch.zeros(2, 16), torch.zeros(2).long()), _step)
    assert got["peak_mib"] is None and got["error"] == why
