"""Fixtures of the prediction's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_job():
    """A tiny MLP job (in 64 -> 16 -> 16 -> 10, batch 4, DDP), composed once with the real
    config tree; tests copy it before changing it."""
    from sharded_exp.compose import compose

    return compose(["model.hidden=16", "model.depth=2", "trainer.batch_size=4", "trainer.grad_accum=1"])
