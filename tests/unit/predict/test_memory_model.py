"""sharded_exp.predict.memory_model: optimizer-state bytes, every rank's model states by
strategy (DDP whole, OSS / ZeRO-1 by their greedy partitions, FSDP by dim-0 shards),
the largest group's state, and the ZeRO paper's bytes per parameter."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from sharded_exp.predict.memory_model import (
    MIB,
    largest_group_state_mib,
    optimizer_state_bytes,
    predict_model_states_mib,
    zero_paper_bytes_per_param,
)
from sharded_exp.strategies import STRATEGIES

ADAM = SimpleNamespace(name="adam", momentum=0.0)
SGD = SimpleNamespace(name="sgd", momentum=0.0)
SGD_MOMENTUM = SimpleNamespace(name="sgd", momentum=0.9)


def strategy(name: str):
    """The strategy's memory model and its default config."""
    return STRATEGIES.builder(name).memory, STRATEGIES.config_class(name)()


def adam_bytes(numels, element=4):
    """Adam keeps exp_avg and exp_avg_sq per element and a 4-byte fp32 ``step`` per tensor."""
    return sum(2 * element * n + 4 for n in numels)


# ------------------------------------------------------------- optimizer_state_bytes
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_state_is_two_moments_per_element_and_a_step_per_tensor(name):
    cfg = SimpleNamespace(name=name, momentum=0.0)
    assert optimizer_state_bytes(cfg, [10, 3]) == (2 * 4 * 10 + 4) + (2 * 4 * 3 + 4)
    # the moments take the parameters' dtype; the step counter stays fp32
    assert optimizer_state_bytes(cfg, [10], element=8) == 2 * 8 * 10 + 4


def test_sgd_keeps_a_momentum_buffer_only_with_momentum():
    assert optimizer_state_bytes(SGD, [10, 3]) == 0
    assert optimizer_state_bytes(SGD_MOMENTUM, [10, 3]) == 4 * 13
    assert optimizer_state_bytes(SGD_MOMENTUM, [10], element=2) == 20


def test_an_optimizer_without_a_memory_model_is_refused():
    with pytest.raises(ValueError, match="no memory model for optimizer 'lion'"):
        optimizer_state_bytes(SimpleNamespace(name="lion", momentum=0.0), [1])


# ----------------------------------------------------------- predict_model_states_mib
def test_ddp_ranks_hold_every_state_in_full():
    groups = [[(8, 4), (4, 2)], [(4,)]]
    numels = [32, 8, 4]
    states = predict_model_states_mib(*strategy("ddp"), ADAM, groups, world_size=3)
    assert len(states) == 3
    for rank in states:
        assert rank == pytest.approx(
            {"params": 4 * 44 / MIB, "grads": 4 * 44 / MIB, "optimizer": adam_bytes(numels) / MIB}
        )


def test_oss_optimizer_state_follows_fairscales_greedy_partition():
    # In order, each to the rank with the least so far (lowest rank on ties):
    # 10 -> r0 (loads 0, 0); 6 -> r1 (10, 0); 5 -> r1 (10, 6); 7 -> r0 (10, 11).
    groups = [[(10,), (6,), (5,)], [(7,)]]
    states = predict_model_states_mib(*strategy("oss"), ADAM, groups, world_size=2)
    assert states[0]["optimizer"] == pytest.approx(adam_bytes([10, 7]) / MIB)
    assert states[1]["optimizer"] == pytest.approx(adam_bytes([6, 5]) / MIB)
    for rank in states:  # OSS shards the optimizer state only
        assert rank["params"] == rank["grads"] == pytest.approx(4 * 28 / MIB)


def test_zero1_partitions_each_group_largest_first():
    # ZeroRedundancyOptimizer sorts the group by size: 10 -> r0, 6 -> r1, 5 -> r1 (6 < 10)
    groups = [[(5,), (10,), (6,)]]
    states = predict_model_states_mib(*strategy("zero1"), ADAM, groups, world_size=2)
    assert states[0]["optimizer"] == pytest.approx(adam_bytes([10]) / MIB)
    assert states[1]["optimizer"] == pytest.approx(adam_bytes([5, 6]) / MIB)


def test_fsdp_holds_padded_dim0_shards_and_the_unpadded_shards_state():
    # (10, 4) on 4 ranks: torch.chunk gives rows 3, 3, 3, 1; storage is padded to 3 rows each
    groups = [[(10, 4)]]
    states = predict_model_states_mib(*strategy("fsdp"), ADAM, groups, world_size=4)
    for rank, rows in enumerate([3, 3, 3, 1]):
        assert states[rank]["params"] == pytest.approx(4 * 3 * 4 / MIB)
        assert states[rank]["grads"] == pytest.approx(4 * 3 * 4 / MIB)
        assert states[rank]["optimizer"] == pytest.approx(adam_bytes([rows * 4]) / MIB)


def test_frozen_parameters_are_held_without_gradient_or_optimizer_state():
    groups = [[(6, 2)]]
    plain = predict_model_states_mib(*strategy("ddp"), ADAM, groups, world_size=2)
    frozen = predict_model_states_mib(*strategy("ddp"), ADAM, groups, world_size=2, frozen=[(5, 5)])
    assert frozen[1]["params"] == pytest.approx(plain[1]["params"] + 4 * 25 / MIB)
    assert frozen[1]["grads"] == plain[1]["grads"]
    assert frozen[1]["optimizer"] == plain[1]["optimizer"]


def test_element_bytes_scale_parameters_gradients_and_moments():
    groups = [[(16, 16)]]
    states = predict_model_states_mib(*strategy("ddp"), ADAM, groups, world_size=1, element=8)
    assert states[0] == pytest.approx(
        {"params": 8 * 256 / MIB, "grads": 8 * 256 / MIB, "optimizer": (2 * 8 * 256 + 4) / MIB}
    )


def test_only_the_asked_ranks_are_predicted_in_the_asked_order():
    groups = [[(10,), (6,), (5,)]]
    every = predict_model_states_mib(*strategy("oss"), ADAM, groups, world_size=3)
    some = predict_model_states_mib(*strategy("oss"), ADAM, groups, world_size=3, ranks=[2, 0])
    assert some == [every[2], every[0]]


# ------------------------------------------------------------ largest_group_state_mib
def test_the_largest_group_state_is_one_groups_not_the_total():
    groups = [[(100,)], [(30,), (20,)]]
    cls, cfg = strategy("ddp")
    largest = largest_group_state_mib(cls, cfg, ADAM, groups, world_size=2, rank=0)
    assert largest == pytest.approx(adam_bytes([100]) / MIB)


def test_the_largest_group_state_counts_only_the_ranks_own_shard():
    # OSS, 2 ranks: group 0: 100 -> r0; group 1: 30 -> r1, 20 -> r1 (30 < 100)
    groups = [[(100,)], [(30,), (20,)]]
    cls, cfg = strategy("oss")
    assert largest_group_state_mib(cls, cfg, ADAM, groups, 2, rank=1) == pytest.approx(adam_bytes([30, 20]) / MIB)
    assert largest_group_state_mib(cls, cfg, ADAM, groups, 2, rank=0) == pytest.approx(adam_bytes([100]) / MIB)


# ---------------------------------------------------------- zero_paper_bytes_per_param
@pytest.mark.parametrize(
    "stage, gb",
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_figure_1_for_7_5b_parameters_on_64_gpus(stage, gb):
    """Figure 1 of Rajbhandari et al. (2020): Psi = 7.5B, N = 64, K = 12."""
    assert 7.5e9 * zero_paper_bytes_per_param(stage, 64) / 1e9 == pytest.approx(gb, abs=0.05)


def test_zero_paper_stages_at_one_gpu_are_all_the_full_16_bytes():
    assert {zero_paper_bytes_per_param(s, 1) for s in range(4)} == {16}
    assert zero_paper_bytes_per_param(1, 4, k=8) == 2 + 2 + 8 / 4
    assert math.isclose(zero_paper_bytes_per_param(2, 4, k=8), 2 + 10 / 4)


def test_hsdp_shards_within_each_replica_group_only():
    # 4 ranks, 2 replicas: sharded over 2 (rank r is member r % 2); (9, 4) -> rows 5 and 4
    cls = STRATEGIES.builder("fsdp").memory
    cfg = STRATEGIES.config_class("fsdp")(replicate=2)
    states = predict_model_states_mib(cls, cfg, ADAM, [[(9, 4)]], world_size=4)
    assert [s["params"] for s in states] == pytest.approx([4 * 5 * 4 / MIB] * 4)  # padded to 5 rows
    assert [s["optimizer"] for s in states] == pytest.approx([adam_bytes([n]) / MIB for n in (20, 16, 20, 16)])
