"""The rank's mmap threshold: fixed at glibc's default unless the user set glibc's malloc."""

from __future__ import annotations

import pytest

from sharded_exp.launch.host_malloc import fix_mmap_threshold


@pytest.mark.parametrize(
    "env", [{"MALLOC_MMAP_THRESHOLD_": "33554432"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}]
)
def test_a_users_own_malloc_setting_stands(env):
    assert fix_mmap_threshold(env) is None

