"""The host's malloc: the mmap threshold a rank fixes under ``fixed`` (unless the user set glibc's malloc), what its heap holds free, its page faults."""

from __future__ import annotations

import ctypes

import pytest

from sharded_exp.measure.host_malloc import fix_mmap_threshold, heap_free_mib, mapped_from, set_mmap_threshold


@pytest.mark.parametrize(
    "env", [{"MALLOC_MMAP_THRESHOLD_": "33554432"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}]
)
def test_a_users_own_malloc_setting_stands(env):
    assert fix_mmap_threshold(env) is None


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
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, 32 * 2**20),  # left dynamic: above its maximum only
    ],
)
def test_the_blocks_mapped_anew_follow_the_threshold_in_force(env, mapped):
    assert mapped_from(env, fixed=True) == mapped


@pytest.mark.skipif(mapped_from({}) is None, reason="glibc only")
def test_ranks_that_leave_the_threshold_dynamic_map_anew_only_above_its_maximum():
    """trainer.host_mmap_threshold=dynamic (the default): only blocks above 32 MiB are mapped
    every time, unless you set the threshold yourself."""
    assert mapped_from({}) == 32 * 2**20
    assert mapped_from({"MALLOC_MMAP_THRESHOLD_": "65536"}, fixed=False) == 65536


def test_a_rank_fixes_the_threshold_only_when_asked(monkeypatch):
    """trainer.host_mmap_threshold: "fixed" asks mallopt for 4 MiB unless your environment
    sets glibc's malloc; "dynamic" asks nothing of a process that never fixed it, and 32 MiB
    (the dynamic rule's steady state) of one that did for an earlier job, where glibc's rule
    cannot come back; anything else is refused by name. mallopt is recorded, not called: the
    test process's own malloc is left alone."""
    from sharded_exp.measure import host_malloc

    asked = []
    monkeypatch.setattr(host_malloc, "_mallopt_threshold", lambda nbytes: asked.append(nbytes) or nbytes)
    monkeypatch.setattr(host_malloc, "_fixed_here", False)
    assert set_mmap_threshold("dynamic", {}) is None and asked == []
    assert set_mmap_threshold("fixed", {"MALLOC_MMAP_THRESHOLD_": "65536"}) is None and asked == []
    assert set_mmap_threshold("fixed", {}) == 4 * 2**20 and asked == [4 * 2**20]
    monkeypatch.setattr(host_malloc, "_fixed_here", True)  # an earlier job in this process fixed it
    assert set_mmap_threshold("dynamic", {}) == 32 * 2**20 and asked[-1] == 32 * 2**20
    assert set_mmap_threshold("dynamic", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    with pytest.raises(ValueError, match="host_mmap_threshold='static'"):
        set_mmap_threshold("static", {})


@pytest.mark.parametrize(
    "trainer, fixed",
    [({"host_mmap_threshold": "dynamic"}, False), ({"host_mmap_threshold": "fixed"}, True), ({}, False)],
)
def test_the_time_model_reads_the_rule_from_the_config(trainer, fixed):
    from omegaconf import OmegaConf

    from sharded_exp.predict.step_time import fixes_mmap_threshold

    assert fixes_mmap_threshold(OmegaConf.create({"trainer": trainer})) is fixed


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
