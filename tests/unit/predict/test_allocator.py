"""The CUDA caching allocator model: small sequences whose outcome follows from torch's rules.

Each docstring works the outcome by hand from the rules in ``sharded_exp/predict/allocator.py``
(which cites the C++ functions). MiB = 1,048,576 bytes. ``benchmarks/accuracy/allocator_check.py``
replays the same sequences on a real GPU and compares ``torch.cuda.memory_stats()``.
"""

from __future__ import annotations

import pytest

from sharded_exp.predict.allocator import (
    MIB,
    Allocator,
    AllocatorOOM,
    alloc_conf_from_env,
    allocation_size,
    cuda_context_entries,
    parse_alloc_conf,
    round_size,
)


def _s(alloc: Allocator, key: str) -> int:
    return alloc.stats()[key]


def test_round_size_and_segment_sizes():
    """512-byte rounding, roundup_power2_divisions, and the segment a new request gets.

    - 1 -> 512 (below kMinBlockSize); 512 -> 512; 513 -> 1024; 8,000 -> 16 x 512 = 8,192;
      16,000,000 = 31,250 x 512 stays.
    - roundup_power2_divisions:4, 1,200,000 bytes: above 512 x 4; floor power of two 1 MiB;
      step 1 MiB / 4 = 262,144; 1,200,000 rounded down to a step is 1,048,576, so up is
      1,310,720. 1,200 bytes is not above 2,048: plain 512 rounding, 1,536.
    - segments: <= 1 MiB -> 2 MiB; 1 MiB + 512 and 10 MiB - 512 -> 20 MiB; 10 MiB -> 10 MiB;
      16,000,000 -> 8 x 2 MiB = 16,777,216.
    """
    assert [round_size(n) for n in (1, 512, 513, 8_000, 16_000_000)] == [512, 512, 1024, 8_192, 16_000_000]
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1_200_000, four) == 1_310_720
    assert round_size(1_200, four) == 1_536
    assert round_size(4 * MIB, four) == 4 * MIB  # a power of two is its own division
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(16_000_000) == 16_777_216


def test_small_and_large_pools():
    """1 MiB is small: a 2 MiB small-pool segment. 1 MiB + 1 rounds to 1 MiB + 512: large, a
    20 MiB segment, split (remainder 20 MiB - 1 MiB - 512 > 1 MiB), so 1 MiB + 512 allocated.
    Then two 1 KiB requests share the small segment: small reserved stays 2 MiB."""
    a = Allocator()
    a.malloc(MIB)
    a.malloc(MIB + 1)
    a.malloc(1024)
    a.malloc(1024)
    assert _s(a, "reserved_bytes.small_pool.current") == 2 * MIB
    assert _s(a, "allocated_bytes.small_pool.current") == MIB + 2048
    assert _s(a, "reserved_bytes.large_pool.current") == 20 * MIB
    assert _s(a, "allocated_bytes.large_pool.current") == MIB + 512
    assert _s(a, "segment.all.current") == 2


def test_split_and_non_split():
    """A 12 MiB segment (12 MiB >= 10 MiB: the request rounded to 2 MiB), freed and cached.

    - 5 MiB takes it (best fit) and splits: remainder 7 MiB > 1 MiB. Allocated 5 MiB;
      one inactive split block of 7 MiB.
    - Freed, the two halves merge back into the 12 MiB block: inactive_split 0.
    - 11 MiB takes it whole: remainder 1 MiB is not > 1 MiB, so no split, and allocated
      counts the whole 12 MiB block.
    """
    a = Allocator()
    a.free(a.malloc(12 * MIB))
    h = a.malloc(5 * MIB)
    assert _s(a, "allocated_bytes.all.current") == 5 * MIB
    assert _s(a, "inactive_split.all.current") == 1
    assert _s(a, "inactive_split_bytes.all.current") == 7 * MIB
    a.free(h)
    assert _s(a, "inactive_split.all.current") == 0
    a.malloc(11 * MIB)
    assert _s(a, "allocated_bytes.all.current") == 12 * MIB
    assert _s(a, "reserved_bytes.all.current") == 12 * MIB
    assert _s(a, "segment.all.current") == 1


def test_block_reused_across_sizes():
    """8 MiB (< 10 MiB) gets a 20 MiB segment and splits: 8 allocated, 12 free. 12 MiB is the
    best fit for a 12 MiB request: no new segment. Both freed merge into one 20 MiB block,
    which then serves a 20 MiB request whole. Reserved stays 20 MiB, one segment."""
    a = Allocator()
    h1 = a.malloc(8 * MIB)
    h2 = a.malloc(12 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 20 * MIB
    a.free(h1)
    a.free(h2)
    assert _s(a, "inactive_split.all.current") == 0
    a.malloc(20 * MIB)
    assert _s(a, "reserved_bytes.all.peak") == 20 * MIB
    assert _s(a, "segment.all.peak") == 1
    assert _s(a, "allocated_bytes.all.current") == 20 * MIB


def test_fragmentation_forces_a_new_segment():
    """A, B = 8 MiB each split a 20 MiB segment: A [0, 8), B [8, 16), free [16, 20). Freeing A
    leaves 12 MiB free in two pieces (8 and 4), neither >= 10 MiB, so a 10 MiB request gets a
    new 10 MiB segment. Reserved 30 MiB, allocated 18 MiB: 12 MiB fragmentation."""
    a = Allocator()
    ha = a.malloc(8 * MIB)
    a.malloc(8 * MIB)
    a.free(ha)
    a.malloc(10 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 30 * MIB
    assert _s(a, "allocated_bytes.all.current") == 18 * MIB
    assert _s(a, "segment.all.current") == 2
    assert _s(a, "inactive_split.all.current") == 2  # the 8 and 4 MiB pieces


def test_max_split_size_mb():
    """max_split_size_mb:32. A 40 MiB segment is oversize (>= 32 MiB); freed and cached.

    - 30 MiB (< 32) may not take an oversize block: a new 30 MiB segment (reserved 70 MiB).
      Without the setting, 30 MiB would split the 40 MiB block (remainder 10 MiB > 1 MiB):
      reserved 40 MiB.
    - With both freed, 36 MiB (>= 32): best fit is the 40 MiB block, under 36 + 20 MiB
      (max_non_split_rounding_mb), and oversize blocks are never split: allocated 40 MiB.
    """
    a = Allocator(parse_alloc_conf("max_split_size_mb:32"))
    a.free(a.malloc(40 * MIB))
    h = a.malloc(30 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 70 * MIB
    a.free(h)
    a.malloc(36 * MIB)
    assert _s(a, "allocated_bytes.all.current") == 40 * MIB
    assert _s(a, "inactive_split.all.current") == 0

    plain = Allocator()
    plain.free(plain.malloc(40 * MIB))
    plain.malloc(30 * MIB)
    assert _s(plain, "reserved_bytes.all.current") == 40 * MIB


def test_max_split_size_releases_an_oversize_block_before_oom():
    """max_split_size_mb:32, the allocator may take 64 MiB. 40 MiB cached (oversize); 30 MiB may
    not use it and 40 + 30 > 64: release_available_cached_blocks frees the smallest oversize
    block >= max(30, 32) MiB, the 40 MiB one, and the retry gets 30 MiB. That first retry is
    not counted in num_alloc_retries (only the release_cached_blocks retry is)."""
    a = Allocator(parse_alloc_conf("max_split_size_mb:32"), device_bytes=64 * MIB)
    a.free(a.malloc(40 * MIB))
    a.malloc(30 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 30 * MIB
    assert _s(a, "num_alloc_retries") == 0


def test_expandable_segments_remove_the_fragmentation():
    """Five 12 MiB tensors, freed, then four 13 MiB ones (the batch grew by one).

    Plain segments: 12 MiB each (>= 10 MiB, rounded to 2 MiB), cached unsplit; 13 MiB fits
    none of them, so four new 14 MiB segments: peak reserved 60 + 56 = 116 MiB.

    expandable_segments:True: one segment mapped in 20 MiB pages, blocks split at 512 B.
    12 MiB maps page 1, [0, 12); the next finds 8 MiB free before the unmapped space and maps
    page 2, [12, 24); the third fits the free 16 MiB, [24, 36); the fourth maps page 3,
    [36, 48); the fifth fits [48, 60) exactly. 60 MiB mapped = 60 MiB reserved. Freed, it
    merges into one 60 MiB block, which holds the four 13 MiB (52 MiB): peak 60 MiB. The
    mapping adds no ``segment`` count (map_block does not count one).
    """
    for conf, peak in (("", 116 * MIB), ("expandable_segments:True", 60 * MIB)):
        a = Allocator(parse_alloc_conf(conf))
        hs = [a.malloc(12 * MIB) for _ in range(5)]
        for h in hs:
            a.free(h)
        for _ in range(4):
            a.malloc(13 * MIB)
        assert _s(a, "reserved_bytes.all.peak") == peak, conf
    assert _s(a, "segment.all.peak") == 0
    assert _s(a, "allocated_bytes.all.current") == 52 * MIB


def test_expandable_segments_unmap_whole_free_pages():
    """Under expandable segments, 16,000,000 B x 3 map three 20 MiB pages (48,000,000 B needs
    45.8 MiB). Freeing the middle tensor frees [16.0, 32.0) MB, which covers no whole page
    [20 MiB, 40 MiB): empty_cache unmaps nothing. Freeing all, empty_cache unmaps all 60 MiB."""
    a = Allocator(parse_alloc_conf("expandable_segments:True"))
    hs = [a.malloc(16_000_000) for _ in range(3)]
    assert _s(a, "reserved_bytes.all.current") == 60 * MIB
    assert _s(a, "allocated_bytes.all.current") == 48_000_000
    a.free(hs[1])
    a.empty_cache()
    assert _s(a, "reserved_bytes.all.current") == 60 * MIB
    a.free(hs[0])
    a.free(hs[2])
    a.empty_cache()
    assert _s(a, "reserved_bytes.all.current") == 0


def test_expandable_segments_one_per_stream_keep_freed_pages_mapped():
    """Where expandable segments reserve more than plain ones: 90 MiB on a side stream
    (FSDP2's all-gather copy-in), freed, then 90 MiB on the default stream.

    Plain segments: ``get_allocation_size`` gives the request itself (>= 10 MiB, a multiple of
    2 MiB): cudaMalloc(90 MiB) for the side stream; freed, it stays cached under that stream,
    and ``get_free_block`` only matches blocks of the request's stream, so the default stream
    gets a second 90 MiB segment: 180 MiB reserved, 90 MiB allocated.

    expandable_segments:True: ``find_expandable_block`` also looks only at the request's
    stream, so each stream gets a segment of its own. ``map_block`` maps whole 20 MiB pages:
    90 MiB maps 5 pages (100 MiB) and ``should_split`` splits off the free 10 MiB tail
    (>= 512 B). ``free_block`` merges the two again and unmaps nothing, so the side stream keeps
    100 MiB; the default stream's 90 MiB maps another 100 MiB: 200 MiB reserved against
    plain's 180.

    ``empty_cache`` (``release_cached_blocks`` -> ``release_blocks`` -> ``unmap_block``, whole
    pages only): the side stream's 5 pages go; the default stream's free tail [90, 100) MiB
    covers no whole page, so 100 MiB stay reserved. Plain releases the side stream's unsplit
    90 MiB segment: 90 MiB.
    """
    for conf, reserved, after in (("", 180 * MIB, 90 * MIB), ("expandable_segments:True", 200 * MIB, 100 * MIB)):
        a = Allocator(parse_alloc_conf(conf))
        a.free(a.malloc(90 * MIB, stream="all-gather"))
        assert _s(a, "reserved_bytes.all.current") == (reserved // 2), conf  # freed, still reserved
        a.malloc(90 * MIB, stream=0)
        assert _s(a, "allocated_bytes.all.current") == 90 * MIB, conf
        assert _s(a, "reserved_bytes.all.current") == reserved, conf
        a.empty_cache()
        assert _s(a, "reserved_bytes.all.current") == after, conf


def test_cross_stream_free_waits_for_the_stream():
    """A = 8 MiB on stream 0 splits a 20 MiB segment; record_stream(A, 1); free(A).

    - Allocated drops to 0 at once; A stays active (an event waits on stream 1).
    - 8 MiB on stream 0 cannot use A; it splits the free 12 MiB: B [8, 16), free [16, 20).
    - After synchronize(1) the next malloc processes the event: A returns to the pool and a
      third 8 MiB request reuses it exactly. Reserved stays 20 MiB.
    - Without the synchronize, the third request finds only 4 MiB free: a second 20 MiB
      segment (40 MiB).
    - A block freed by stream 0 is not reused by stream 1: 8 MiB on stream 1 is a new segment.
    """
    for sync, reserved in ((True, 20 * MIB), (False, 40 * MIB)):
        a = Allocator()
        ha = a.malloc(8 * MIB, stream=0)
        a.record_stream(ha, 1)
        a.free(ha)
        assert _s(a, "allocated_bytes.all.current") == 0
        assert _s(a, "active_bytes.all.current") == 8 * MIB
        a.malloc(8 * MIB, stream=0)
        assert _s(a, "reserved_bytes.all.current") == 20 * MIB
        if sync:
            a.synchronize(1)
        a.malloc(8 * MIB, stream=0)
        assert _s(a, "reserved_bytes.all.current") == reserved, sync

    b = Allocator()
    b.free(b.malloc(8 * MIB, stream=0))
    b.malloc(8 * MIB, stream="nccl")  # streams may be named
    assert _s(b, "segment.all.current") == 2


def test_oom_retry_after_freeing_the_cache():
    """The allocator may take 40 MiB. 12 and 14 MiB segments, both freed: 26 MiB cached.
    30 MiB fits neither; 26 + 30 > 40, so the cache is released (release_cached_blocks:
    both segments are unsplit) and the retry gets 30 MiB (num_alloc_retries 1). Then 12 MiB:
    30 + 12 > 40 with nothing cached: OOM, naming the 12 MiB request."""
    a = Allocator(device_bytes=40 * MIB)
    h1, h2 = a.malloc(12 * MIB), a.malloc(14 * MIB)
    a.free(h1)
    a.free(h2)
    a.malloc(30 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 30 * MIB
    assert _s(a, "num_alloc_retries") == 1
    with pytest.raises(AllocatorOOM, match="request of 12582912 bytes") as err:
        a.malloc(12 * MIB)
    assert err.value.size == 12 * MIB and err.value.reserved == 30 * MIB
    assert _s(a, "num_ooms") == 1


def test_garbage_collection_threshold():
    """garbage_collection_threshold:0.5, memory fraction 0.5 of 200 MiB: allowed 100 MiB,
    threshold 50 MiB. Ages count get_free_block calls on the large pool since a block was cached.

    A = 30 MiB (call 1), freed (cached at 1); B = 40 MiB (call 2: A too small; reserved 30 <= 50,
    no gc; a 40 MiB segment), freed (cached at 2). C = 50 MiB (call 3): no fit; reserved 70 > 50,
    reclaim 20: ages A 2, B 1, average 1.5; A is at least that and goes (30 MiB reclaimed, enough).
    C's 50 MiB segment: 40 + 50 = 90 <= 100. Reserved 90 MiB, segments B and C.
    Without the threshold (same fraction): 70 + 50 > 100 fails, release_cached_blocks frees A and
    B, reserved ends at 50 MiB with a retry counted.
    """
    a = Allocator(parse_alloc_conf("garbage_collection_threshold:0.5"), device_bytes=200 * MIB, memory_fraction=0.5)
    b = Allocator(device_bytes=200 * MIB, memory_fraction=0.5)
    for x in (a, b):
        x.free(x.malloc(30 * MIB))
        x.free(x.malloc(40 * MIB))
        x.malloc(50 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 90 * MIB
    assert _s(a, "segment.all.current") == 2
    assert _s(a, "num_alloc_retries") == 0
    assert _s(b, "reserved_bytes.all.current") == 50 * MIB
    assert _s(b, "num_alloc_retries") == 1


def test_parse_alloc_conf_good():
    """The usual settings, spaces ignored. The bracket form follows parseRoundUpPower2Divisions:
    256 MiB is interval 8, so intervals 0..8 get 1; 512 -> interval 9 gets 2; 1024 -> 10 gets 4;
    '>' fills the intervals after the last one named (11..15) with 8."""
    s = parse_alloc_conf(
        "max_split_size_mb: 128,expandable_segments:True,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
    )
    assert s.max_split_size == 128 * MIB
    assert s.expandable_segments is True
    assert s.garbage_collection_threshold == 0.6
    assert s.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    assert parse_alloc_conf(None) == parse_alloc_conf("")
    assert (
        parse_alloc_conf("expandable_segments:False,max_non_split_rounding_mb:64").max_non_split_rounding_size
        == 64 * MIB
    )
    cuda_only = parse_alloc_conf(
        "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True,pinned_num_register_threads:8"
    )
    assert cuda_only.per_process_memory_fraction == 0.5 and cuda_only.pinned_num_register_threads == 8


def test_large_segment_size_mb():
    """large_segment_size_mb:64 is read before the other options: max_non_split_rounding_mb
    defaults to it (64 MiB) and max_split_size_mb must be at least 64. A 5 MiB request (1-10 MiB)
    now gets a 64 MiB segment, and under expandable segments the large pool maps 64 MiB pages."""
    s = parse_alloc_conf("max_split_size_mb:64,large_segment_size_mb:64")
    assert (s.large_segment_size, s.max_non_split_rounding_size, s.max_split_size) == (64 * MIB,) * 3
    assert allocation_size(5 * MIB, s) == 64 * MIB
    a = Allocator(s)
    a.malloc(5 * MIB)
    assert _s(a, "reserved_bytes.all.current") == 64 * MIB
    e = Allocator(parse_alloc_conf("large_segment_size_mb:64,expandable_segments:True"))
    e.malloc(30 * MIB)
    assert _s(e, "reserved_bytes.all.current") == 64 * MIB
    with pytest.raises(ValueError, match="must be >= 64"):
        parse_alloc_conf("large_segment_size_mb:64,max_split_size_mb:32")
    with pytest.raises(ValueError, match="must be > 10"):
        parse_alloc_conf("large_segment_size_mb:10")


@pytest.mark.parametrize(
    "conf, message",
    [
        ("max_split_mb:128", "unknown option 'max_split_mb'.*max_split_size_mb"),
        ("max_split_size_mb:10", "must be >= 20"),
        ("expandable_segments:true", "True or False"),
        ("garbage_collection_threshold:1.5", r"\(0.0, 1.0\)"),
        ("per_process_memory_fraction:1.5", r"\[0.0, 1.0\]"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[256:1,512:2", "']'"),
        ("max_split_size_mb:128;expandable_segments:True", "integer"),
        ("max_split_size_mb", "':'"),
        ("backend:cudaMalloc", "native"),
    ],
)
def test_parse_alloc_conf_bad(conf, message):
    """A typo or a bad value is a ValueError that names it (and, for a key, lists the options)."""
    with pytest.raises(ValueError, match=message):
        parse_alloc_conf(conf)


def test_alloc_conf_from_env_prefers_the_cuda_variable():
    """CUDAAllocatorConfig reads PYTORCH_CUDA_ALLOC_CONF first, then PYTORCH_ALLOC_CONF."""
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert alloc_conf_from_env(both) == "expandable_segments:True"
    assert alloc_conf_from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == "max_split_size_mb:64"
    assert alloc_conf_from_env({}) is None


def test_memory_fraction_one_sets_no_cap():
    """setMemoryFraction (torch >= 2.10) caps memory only below 1.0: at 1.0 a 40 MiB device still
    OOMs through cudaMalloc (device_bytes), not through the cap, and gc stays off."""
    a = Allocator(parse_alloc_conf("garbage_collection_threshold:0.5"), device_bytes=40 * MIB, memory_fraction=1.0)
    assert a.allowed is None and not a._gc_on
    half = Allocator(parse_alloc_conf("per_process_memory_fraction:0.5"), device_bytes=40 * MIB)
    assert half.allowed == 20 * MIB
    with pytest.raises(AllocatorOOM):
        half.malloc(30 * MIB)


def test_zero_recipe_335_mb_after_building():
    """PyTorch's ZeroRedundancyOptimizer recipe: 20 x Linear(2000, 2000) on the GPU.

    Weight: 2000 x 2000 x 4 = 16,000,000 B = 31,250 x 512 (no rounding); >= 10 MiB, so a
    segment of 16,000,000 rounded up to 2 MiB = 8 x 2,097,152 = 16,777,216; the remainder
    777,216 is not > 1 MiB, so the block is not split and counts whole: 16,777,216 B.
    Bias: 2000 x 4 = 8,000 B -> 8,192 B, small pool; 20 of them (163,840 B) share one 2 MiB
    segment. max_memory_allocated = 20 x 16,777,216 + 20 x 8,192 = 335,544,320 + 163,840 =
    335,708,160 B, which the recipe prints as 335 MB (// 1e6), not 320 (20 x 16e6 / 1e6).
    Reserved: 20 x 16 MiB + 2 MiB = 337,641,472 B in 21 segments.
    """
    a = Allocator()
    for _ in range(20):
        a.malloc(2000 * 2000 * 4)
        a.malloc(2000 * 4)
    assert _s(a, "allocated_bytes.all.peak") == 335_708_160
    assert _s(a, "allocated_bytes.all.peak") // 10**6 == 335
    assert _s(a, "reserved_bytes.all.peak") == 337_641_472
    assert _s(a, "segment.all.current") == 21


def test_replay_reports_peaks_and_oom():
    """replay() runs (op, id, size, stream) events: 8 MiB then 8 MiB then free the first then
    10 MiB is the fragmentation sequence above: peak reserved 30 MiB, allocated peak 18 MiB,
    fragmentation at the reserved peak 30 - 18 = 12 MiB. With 20 MiB allowed, the 10 MiB
    request cannot be served (nothing is cached unsplit): the replay stops with the OOM."""
    events = [
        ("malloc", "a", 8 * MIB, 0),
        ("malloc", "b", 8 * MIB, 0),
        ("free", "a", 0, 0),
        ("malloc", "c", 10 * MIB, 0),
    ]
    r = Allocator().replay(events)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (30 * MIB, 18 * MIB)
    assert r.fragmentation_at_peak_reserved_bytes == 12 * MIB
    assert r.oom is None and r.events == 4
    r = Allocator(device_bytes=20 * MIB).replay(events)
    assert r.oom is not None and r.oom.size == 10 * MIB and r.events == 4
    with pytest.raises(ValueError, match="unknown replay op"):
        Allocator().replay([("alloc", 1, 8, 0)])


def test_a_replay_of_a_7b_plans_size_counts_every_live_block():
    """10^5 events (50,000 tensors of mixed sizes over two streams, freed in waves), as many as
    a 7B plan replays: the peak allocated is at least the largest sum of 64 live requests, and
    at most that plus what a block too little larger than its request to be split keeps, under
    1 MiB each (kSmallSize). Its speed is the planner's benchmark's to measure
    (benchmarks/harness/planner_speed.py), not a timed unit test's."""
    events, sizes = [], []
    for i in range(50_000):
        size = (1 + (i * 7919) % 4096) * 4096
        sizes.append(size)
        events.append(("malloc", i, size, i % 2))
        if i >= 64:
            events.append(("free", i - 64, 0, 0))
    events = events[:100_000]
    r = Allocator().replay(events)
    assert r.oom is None
    live, peak, held = {}, 0, 0
    for kind, i, size, _ in events:
        if kind == "malloc":
            live[i] = size  # multiples of 4096: already whole 512-byte units
            held += size
            peak = max(peak, held)
        else:
            held -= live.pop(i)
    assert peak <= r.peak_allocated_bytes < peak + 64 * MIB


def _check_invariants(a: Allocator) -> None:
    """Blocks tile their segments; the counters equal what the blocks say."""
    blocks = list(a._handles.values())
    for pool in (a.small, a.large):
        blocks += list(pool.by_addr.values()) + list(pool.unmapped_by_addr.values())
    for q in a._events.values():
        blocks += [b for _, b in q]
    heads = {}
    for b in blocks:
        h = b
        while h.prev is not None:
            h = h.prev
        heads[id(h)] = h
    mapped = free_split = free_split_bytes = 0
    for h in heads.values():
        x, end = h, None
        while x is not None:
            assert end is None or x.addr == end, "blocks of a segment must be contiguous"
            end = x.addr + x.size
            mapped += x.size if x.mapped else 0
            if x.seg is None and x.is_split() and not x.allocated and x.event_count == 0:
                free_split += 1
                free_split_bytes += x.size
            x = x.next
    s = a.stats()
    assert s["reserved_bytes.all.current"] == mapped == a.total_reserved
    assert s["allocated_bytes.all.current"] == sum(b.size for b in a._handles.values())
    assert s["inactive_split.all.current"] == free_split
    assert s["inactive_split_bytes.all.current"] == free_split_bytes


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:24", "roundup_power2_divisions:4"])
def test_invariants_hold_on_random_sequences(conf):
    """Random mallocs (512 B .. 48 MiB), frees, cross-stream frees, syncs and empty_cache on three
    streams under a 1 GiB limit: after every step the blocks tile their segments and the
    counters agree with them (reserved = mapped bytes, allocated = live blocks, inactive_split
    = free split blocks)."""
    import random

    rng = random.Random(47)
    a = Allocator(parse_alloc_conf(conf), device_bytes=1024 * MIB)
    live = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.5 or not live:
            size = rng.choice([rng.randint(1, 4096), rng.randint(4096, 2 * MIB), rng.randint(MIB, 48 * MIB)])
            try:
                live.append(a.malloc(size, stream=rng.randint(0, 2)))
            except AllocatorOOM:
                pass
        elif r < 0.85:
            h = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.2:
                a.record_stream(h, rng.randint(0, 2))
            a.free(h)
        elif r < 0.97:
            a.synchronize(rng.choice([None, 0, 1, 2]))
        else:
            a.empty_cache()
        _check_invariants(a)


def test_cuda_context_figures_name_their_source():
    """Every CUDA context figure says where it was published, for which torch and device."""
    entries = cuda_context_entries()
    assert entries
    for e in entries:
        assert e["source"].startswith("https://") and e["torch"] and e["device"] and e["figure"]
        assert e["context_bytes"] is None or 100 * MIB < e["context_bytes"] < 2048 * MIB
