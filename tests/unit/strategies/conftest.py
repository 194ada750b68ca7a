"""Fixtures of the strategies' unit tests: an in-process fake process group of any size."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_group():
    """Call ``fake_group(world_size, rank=0)`` to open torch's fake process group (no peers,
    collectives do nothing) as one rank of ``world_size``; destroyed after the test."""

    def start(world_size: int, rank: int = 0) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
