"""The host's malloc: what a rank's rule sets (unless the user set glibc's malloc), what its heap holds free, its page faults."""

from __future__ import annotations

import ctypes
import sys

import pytest

from sharded_exp.measure.host_malloc import heap_free_mib, mapped_from, set_malloc_rule


@pytest.mark.parametrize(
    "env",
    [{"MALLOC_MMAP_THRESHOLD_": "33554432"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
     {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}],
)  # fmt: skip
@pytest.mark.parametrize("rule", ["reuse", "fixed", "dynamic"])
def test_a_users_own_malloc_setting_stands(env, rule, monkeypatch):
    from sharded_exp.measure import host_malloc

    monkeypatch.setattr(host_malloc, "_set_here", True)  # even after an earlier job's rule
    monkeypatch.setattr(host_malloc, "_mallopt", lambda settings: pytest.fail(f"mallopt asked for {settings}"))
    assert set_malloc_rule(rule, env) is None


@pytest.mark.skipif(heap_free_mib() is None, reason="glibc's mallinfo2 only")
def test_the_heap_counts_small_blocks_freed_between_live_ones():
    """Blocks below the mmap threshold freed between live ones stay with the heap: counted free."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(64)]  # 4 MiB in 64 KiB blocks, from the heap
    before = heap_free_mib()
    for block in blocks[::2]:  # every other one: none can merge with the top and be trimmed
        libc.free(block)
    freed = heap_free_mib() - before
    for block in blocks[1::2]:
        libc.free(block)
    assert freed >= 32 * 64 / 1024 * 0.99, freed  # 2 MiB freed, each block with its header


@pytest.mark.skipif(mapped_from({}) is None, reason="glibc only")
@pytest.mark.parametrize(
    "env, mapped",
    [
        ({}, 4 * 2**20),  # the threshold a rank fixes
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, 65536),  # yours
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=262144"}, 262144),
        ({"MALLOC_MMAP_THRESHOLD_": "0x3000000"}, 48 * 2**20),  # glibc reads hexadecimal too
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, 4 * 2**20),  # not what the rules set: the rule stands
        ({"MALLOC_ARENA_MAX": "1"}, 4 * 2**20),
        # a trim threshold of yours stops the threshold moving from glibc's 128 KiB (mallopt(3))
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, 128 * 1024),
        ({"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}, 128 * 1024),
        ({"MALLOC_MMAP_MAX_": "0"}, sys.maxsize),  # no block is ever mapped
    ],
)
def test_the_blocks_mapped_anew_follow_the_threshold_in_force(env, mapped):
    assert mapped_from(env, rule="fixed") == mapped


@pytest.mark.skipif(mapped_from({}) is None, reason="glibc only")
def test_ranks_that_reuse_the_heap_or_leave_glibc_its_rule_map_anew_only_above_32_mib():
    """trainer.host_mmap_threshold=reuse (the default) sets the threshold at the dynamic rule's
    maximum, where =dynamic leaves it to rise: only blocks above 32 MiB are mapped every time,
    unless you set the threshold yourself."""
    assert mapped_from({}) == mapped_from({}, rule="dynamic") == 32 * 2**20
    assert mapped_from({"MALLOC_MMAP_THRESHOLD_": "65536"}, rule="reuse") == 65536


def test_each_rule_sets_both_thresholds_and_glibcs_own_sets_nothing(monkeypatch):
    """trainer.host_mmap_threshold, as (mmap threshold, trim threshold): "reuse" asks mallopt
    for 32 MiB and no trimming (-1), "fixed" for 4 MiB and glibc's 128 KiB; "dynamic" asks
    nothing of a process no rule touched, and the dynamic rule's steady state (32 MiB, trimmed
    above twice that) of one an earlier job's rule set, where glibc's rule cannot come back;
    anything else is refused by name. mallopt is recorded, not called: the test process's own
    malloc is left alone."""
    from sharded_exp.measure import host_malloc

    asked = []
    monkeypatch.setattr(host_malloc, "_mallopt", lambda settings: asked.append(settings) or settings)
    monkeypatch.setattr(host_malloc, "_set_here", False)
    assert set_malloc_rule("dynamic", {}) is None and asked == []
    assert set_malloc_rule("reuse", {}) == (32 * 2**20, -1) and asked == [(32 * 2**20, -1)]
    assert set_malloc_rule("fixed", {}) == (4 * 2**20, 128 * 1024)
    monkeypatch.setattr(host_malloc, "_set_here", True)  # an earlier job in this process set a rule
    assert set_malloc_rule("dynamic", {}) == (32 * 2**20, 64 * 2**20) and asked[-1] == (32 * 2**20, 64 * 2**20)
    assert set_malloc_rule("dynamic", {"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}) is None  # yours
    assert set_malloc_rule("reuse", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == (32 * 2**20, -1)  # not
    with pytest.raises(ValueError, match="host_mmap_threshold='static' must be one of reuse, fixed, dynamic"):
        set_malloc_rule("static", {})


@pytest.mark.parametrize(
    "trainer, rule",
    [({"host_mmap_threshold": "dynamic"}, "dynamic"), ({"host_mmap_threshold": "fixed"}, "fixed"), ({}, "reuse")],
)
def test_the_time_model_reads_the_rule_from_the_config(trainer, rule):
    from omegaconf import OmegaConf

    from sharded_exp.predict.step_time import malloc_rule

    assert malloc_rule(OmegaConf.create({"trainer": trainer})) == rule


def test_a_process_counts_its_page_faults():
    """Touching new pages raises the process's minor-fault count by about as many pages."""
    import mmap

    from sharded_exp.measure.host_malloc import minor_faults

    before = minor_faults()
    if before is None:
        pytest.skip("no getrusage here")
    pages = 256
    block = mmap.mmap(-1, pages * mmap.PAGESIZE)  # anonymous: no page resident until written
    for i in range(pages):
        block[i * mmap.PAGESIZE] = 1
    assert minor_faults() - before >= pages
    block.close()
