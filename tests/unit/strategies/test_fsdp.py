"""strategies/fsdp.py: FSDP2's memory model (dim-0 shards as torch.chunk cuts them, padded
storage for params and grads, HSDP's replica groups, the units gathered at the peak), held
against real ``fully_shard`` shards under a fake process group; the config checks and the
mixed-precision policy."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.config import PrecisionConfig
from sharded_exp.errors import ConfigError
from sharded_exp.strategies.fsdp import (
    FSDP,
    DType,
    FSDPConfig,
    FSDPGradOp,
    FSDPGradOpConfig,
    _padded_numel,
    _shard_numel,
    policy,
    shard_group,
)


def _cfg(**kw):
    return OmegaConf.structured(FSDPConfig(**kw))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(1,), (5,), (5, 7), (8, 3), (9, 2, 2)])
def test_a_ranks_shard_has_the_rows_torch_chunk_gives_it(shape, world_size):
    chunks = torch.empty(shape).chunk(world_size)  # may be fewer than world_size: the last ranks get none
    for rank in range(world_size):
        expected = chunks[rank].numel() if rank < len(chunks) else 0
        assert _shard_numel(shape, rank, world_size) == expected, (shape, rank)


def test_padded_storage_holds_equal_chunks_and_a_0_dim_parameter_is_whole():
    assert _padded_numel((5, 7), 3) == 2 * 7
    assert _padded_numel((6, 7), 3) == 2 * 7
    assert _padded_numel((1, 4), 8) == 4
    assert _padded_numel((), 4) == 1 and _shard_numel((), 3, 4) == 1


SHAPES = [(5, 7), (5,), (3, 5), (3,), ()]


def test_params_and_grads_are_padded_and_optimizer_state_follows_the_real_shard():
    # rank 2 of 3: rows 4..4 of 5 (chunks of 2), row 2 of 3 (chunks of 1)
    held = FSDP.memory.resident_numel(_cfg(), SHAPES, FSDP.memory.partition([[35, 5, 15, 3, 1]], 3), 2, 3)
    assert held["optimizer"] == [7, 1, 5, 1, 1]
    assert held["params"] == held["grads"] == 14 + 2 + 5 + 1 + 1
    held0 = FSDP.memory.resident_numel(_cfg(), SHAPES, [], 0, 3)
    assert held0["optimizer"] == [14, 2, 5, 1, 1] and held0["params"] == 23


def test_hsdp_shards_within_a_replica_group_only():
    # 4 ranks in 2 replica groups of 2: rank 3 is member 1 of its group
    hsdp = FSDP.memory.resident_numel(_cfg(replicate=2), SHAPES, [], 3, 4)
    assert hsdp == FSDP.memory.resident_numel(_cfg(), SHAPES, [], 1, 2)
    assert hsdp["optimizer"] == [14, 2, 5, 1, 1] and hsdp["params"] == 21 + 3 + 10 + 2 + 1
    assert shard_group(_cfg(replicate=2), 8) == 4 and shard_group(_cfg(), 8) == 8


def test_every_rank_owns_a_slice_of_every_tensors_state():
    assert FSDP.memory.partition([[3, 4], [5]], 4) == [-1, -1, -1]


def test_with_resharding_the_root_and_the_largest_unit_are_gathered_without_it_every_unit():
    assert FSDP.memory.transient_param_numel(_cfg(), [10, 30, 20], 7, 4) == 7 + 30
    assert FSDP.memory.transient_param_numel(_cfg(reshard_after_forward=False), [10, 30, 20], 7, 4) == 7 + 60
    assert FSDP.memory.transient_param_numel(_cfg(), [], 7, 4) == 7
    assert FSDPGradOp.memory.transient_param_numel(OmegaConf.structured(FSDPGradOpConfig), [10, 30], 7, 4) == 47


def test_fsdp_facts():
    assert FSDP.traits.sharding == 4 and FSDPGradOp.traits.sharding == 3
    assert FSDP.traits.checkpoint_format_auto == FSDPGradOp.traits.checkpoint_format_auto == "dcp"
    assert FSDPConfig().reshard_after_forward is True and FSDPGradOpConfig().reshard_after_forward is False
    assert FSDP.memory.depth_line_from == 3 and FSDP.traits.grads_differ_across_ranks


@pytest.mark.parametrize("replicate, world_size", [(3, 4), (5, 6)])
def test_a_replicate_that_does_not_divide_the_world_is_refused_naming_the_divisors(replicate, world_size):
    divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
    with pytest.raises(ConfigError, match=f"replicate={replicate} must divide trainer.world_size={world_size} "
                       f"\\(HSDP: .*divisors: {divisors}\\)"):  # fmt: skip
        FSDP.check(_cfg(replicate=replicate), world_size, "cpu")
    with pytest.raises(ConfigError, match="replicate=0 must be >= 1"):
        FSDP.check(_cfg(replicate=0), world_size, "cpu")


def test_a_dividing_replicate_passes_and_cpu_offload_is_for_gpus_only():
    FSDP.check(_cfg(replicate=2), 4, "cpu")
    FSDP.check(_cfg(replicate=4), 4, "cpu")
    FSDP.check(_cfg(cpu_offload=True), 2, "cuda")
    with pytest.raises(ConfigError, match="cpu_offload=true.*on cpu"):
        FSDP.check(_cfg(cpu_offload=True), 2, "cpu")


def _precision(name):
    return OmegaConf.structured(PrecisionConfig(name=name))


def test_the_policy_computes_in_the_precisions_dtype_and_reduces_in_float32():
    plain = policy(_cfg(), _precision("32"))
    assert plain.param_dtype is None and plain.reduce_dtype is None
    bf16 = policy(_cfg(), _precision("bf16"))
    assert bf16.param_dtype is torch.bfloat16 and bf16.reduce_dtype is torch.float32
    assert policy(_cfg(), _precision("16")).param_dtype is torch.float16


def test_the_policy_takes_the_asked_dtypes_over_the_precisions():
    asked = policy(_cfg(param_dtype=DType.bfloat16), _precision("32"))
    assert asked.param_dtype is torch.bfloat16 and asked.reduce_dtype is torch.float32
    reduce_only = policy(_cfg(reduce_dtype=DType.float16), _precision("32"))
    assert reduce_only.param_dtype is None and reduce_only.reduce_dtype is torch.float16
    both = policy(_cfg(param_dtype=DType.float32, reduce_dtype=DType.bfloat16), _precision("bf16"))
    assert both.param_dtype is torch.float32 and both.reduce_dtype is torch.bfloat16


@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2), (4, 3), (8, 5)])
def test_the_predicted_shards_are_real_fully_shard_shards(fake_group, world_size, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fake_group(world_size, rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(3, 9))
    shapes = [tuple(p.shape) for p in net.parameters()]
    fully_shard(net, mesh=init_device_mesh("cpu", (world_size,)))
    held = FSDP.memory.resident_numel(_cfg(), shapes, FSDP.memory.partition([[math.prod(s) for s in shapes]], world_size), rank,
                               world_size)  # fmt: skip
    params = list(net.parameters())
    assert held["optimizer"] == [p.to_local().numel() for p in params]
    assert held["params"] * 4 == sum(p._local_tensor.untyped_storage().nbytes() for p in params)  # padded


def test_the_predicted_optimizer_state_is_a_real_adam_over_fully_shard(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fake_group(3, 2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 4))
    shapes = [tuple(p.shape) for p in net.parameters()]
    fully_shard(net, mesh=init_device_mesh("cpu", (3,)))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    real = sum(t.to_local().numel() * 4 for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert real == 2 * 4 * sum(FSDP.memory.resident_numel(_cfg(), shapes, [], 2, 3)["optimizer"])


@pytest.mark.parametrize("world_size, rank", [(3, 2), (4, 1)])
def test_the_pinned_tensors_are_real_fully_shard_shards(fake_group, world_size, rank):
    """CPU offload pins each parameter's padded storage and each gradient's own rows: the
    local storage and the local tensor of a real fully_shard parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fake_group(world_size, rank)
    net = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    shapes = [tuple(p.shape) for p in net.parameters()]
    fully_shard(net, mesh=init_device_mesh("cpu", (world_size,)))
    params = list(net.parameters())
    padded = [p._local_tensor.untyped_storage().nbytes() // 4 for p in params]
    own = [p.to_local().numel() for p in params]
    assert FSDP.memory.pinned_numels(_cfg(), shapes, [], rank, world_size) == padded + own


def test_an_offloaded_build_steps_its_optimizer_as_torch_does_on_the_host(fake_group, monkeypatch):
    """Under CPU offload the states live on the host: a GPU run's optimizer is built per tensor
    there (torch's choice for CPU tensors), not with CUDA's foreach (fully_shard stubbed: this
    machine has no GPU to offload from)."""
    from sharded_exp.optim import optimizer_spec
    from sharded_exp.strategies import fsdp

    fake_group(2)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: module)
    built = {}
    for offload in (False, True):
        spec = optimizer_spec(OmegaConf.create({"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                "weight_decay": 0.0, "no_decay_lr_scale": 1.0, "foreach": None}),
                              nn.Linear(4, 4), torch.device("cuda"))  # fmt: skip
        net = nn.Sequential(nn.Linear(4, 4))
        strategy = FSDP.build(_cfg(cpu_offload=offload), net, spec, _precision("32"), torch.device("cpu"))
        built[offload] = strategy.optimizer.defaults["foreach"]
    assert built == {False: True, True: False}
