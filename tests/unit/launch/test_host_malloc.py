"""The rank's mmap threshold: fixed at glibc's default unless the user set glibc's malloc."""

from __future__ import annotations

import ctypes
import platform

import pytest

from sharded_exp.launch.host_malloc import MMAP_THRESHOLD_BYTES, fix_mmap_threshold

glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize(
    "env", [{"MALLOC_MMAP_THRESHOLD_": "33554432"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}]
)
def test_a_users_own_malloc_setting_stands(env):
    assert fix_mmap_threshold(env) is None


@pytest.mark.skipif(not glibc, reason="glibc's dynamic mmap threshold only")
def test_a_freed_large_block_no_longer_raises_the_threshold():
    """With the threshold fixed, a 4 MiB block freed and asked for again is mapped anew,
    outside the heap. Under glibc's dynamic rule the free raises the threshold to 4 MiB, and
    the second block comes from the heap (and stays resident once freed)."""
    assert fix_mmap_threshold({}) == MMAP_THRESHOLD_BYTES
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 4 * 2**20
    libc.free(libc.malloc(size))
    second = libc.malloc(size)
    try:
        with open("/proc/self/maps") as f:
            heaps = [line.split()[0].split("-") for line in f if "[heap]" in line]
        assert not any(int(lo, 16) <= second < int(hi, 16) for lo, hi in heaps)
    finally:
        libc.free(second)
