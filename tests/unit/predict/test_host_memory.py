"""CPU offload's host memory: torch's pinned-memory rounding, FSDP2's pinned tensors, a node's sum."""

import pytest
from omegaconf import OmegaConf

from sharded_exp.predict.allocator import UNLIMITED, parse_alloc_conf
from sharded_exp.predict.host_memory import node_mib, offload_host_mib, pinned_block_bytes
from sharded_exp.strategies.fsdp import FSDPMemory

MIB = 2**20
DEFAULT = parse_alloc_conf(None)


@pytest.mark.parametrize(
    ("size", "block"),
    [
        (0, 0),  # an empty shard pins nothing
        (1, 1),
        (512, 512),
        (513, 1024),
        (112 * MIB, 128 * MIB),  # Llama 2 70B's MLP weight shard at 8 ranks: 3,584 x 8,192 fp32
        (125 * MIB, 128 * MIB),  # its 32,000-row embedding's shard
        (8 * MIB, 8 * MIB),  # an attention projection's: already a power of two
    ],
)
def test_a_pinned_request_takes_the_next_power_of_two(size, block):
    """CachingHostAllocatorImpl::allocate rounds with c10::llvm::PowerOf2Ceil."""
    assert pinned_block_bytes(size, DEFAULT) == block


def test_torch_2_13s_thresholds_stop_the_rounding_above_them():
    """pinned_max_round_threshold_mb: 64 rounds 48 MiB to 64 but leaves 112 MiB as it is;
    pinned_max_cached_size_mb: 32 (smaller) wins over it: 48 MiB is neither rounded nor cached."""
    settings = parse_alloc_conf("pinned_max_round_threshold_mb:64")
    assert settings.pinned_max_round_threshold == 64 * MIB and settings.pinned_max_cached_size == UNLIMITED
    assert pinned_block_bytes(48 * MIB, settings) == 64 * MIB
    assert pinned_block_bytes(112 * MIB, settings) == 112 * MIB
    both = parse_alloc_conf("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:32")
    assert pinned_block_bytes(48 * MIB, both) == 48 * MIB
    assert pinned_block_bytes(20 * MIB, both) == 32 * MIB


def test_a_bad_pinned_threshold_is_refused_naming_it():
    with pytest.raises(ValueError, match="pinned_max_cached_size_mb takes a non-negative integer, got 'lots'"):
        parse_alloc_conf("pinned_max_cached_size_mb:lots")


def test_one_mlp_weights_shard_on_the_host_worked_by_hand():
    """Llama 2 70B's gate projection (28,672 x 8,192) at 8 ranks, fp32, Adam: a shard of 3,584
    rows, 29,360,128 elements, 112 MiB. Pinned: the parameter and the gradient, 128 MiB each
    (256). Adam's two moments, pageable: 224 MiB and a 4-byte step. The host step's new
    tensors, here 4 bytes an element (a foreach Adam's square root) of the one shard it steps:
    112 MiB. 592 MiB and 4 bytes, where the states' bytes are 448 MiB and 4 bytes."""
    shard = 3584 * 8192
    adam = OmegaConf.create({"name": "adam"})
    out = offload_host_mib([shard, shard], [shard], adam, 4.0, DEFAULT, step_elements=shard, step_bytes_per_element=4)
    assert out == {"pinned": 256.0, "tensor_bytes": 224.0, "optimizer": 224.0 + 4 / MIB, "step": 112.0,
                   "total": 592.0 + 4 / MIB}  # fmt: skip


def test_fsdp_pins_padded_parameter_shards_and_unpadded_gradient_shards():
    """A (10, 3) weight at 4 ranks: chunks of 3 rows, so every rank pins a padded 9-element
    parameter shard; the gradient shards are the rows each rank owns: 9, 9, 9 and 3 (rank 3
    has row 9 only). A frozen (6,) bias: a 2-element parameter shard, no gradient."""
    cfg = OmegaConf.create({"replicate": 1})
    assert FSDPMemory.pinned_numels(cfg, [(10, 3)], [(6,)], 0, 4) == [9, 2, 9]
    assert FSDPMemory.pinned_numels(cfg, [(10, 3)], [(6,)], 3, 4) == [9, 2, 3]
    # HSDP over 2 replicas of 2: sharded in halves; rank 3 is rank 1 of its group
    hsdp = OmegaConf.create({"replicate": 2})
    assert FSDPMemory.pinned_numels(hsdp, [(10, 3)], [], 3, 4) == [15, 15]


def test_a_node_holds_its_fullest_ranks():
    assert node_mib([3.0, 1.0, 2.0, 5.0], 2) == 8.0
    assert node_mib([3.0, 1.0], 8) == 4.0  # fewer ranks than a node's GPUs
