"""Fixtures for the train package's unit tests: a world-size-1 gloo group, torn down after."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo1():
    """A world-size-1 gloo process group (in-process), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
