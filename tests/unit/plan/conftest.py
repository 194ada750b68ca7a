"""Fixtures of the planner's unit tests: configs composed once (plan.yaml); each test copies
what it changes."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plan_cfg():
    """The planner's default composed config (model=mlp, strategy=ddp, adam, precision 32)."""
    from sharded_exp.compose import compose

    return compose([], config_name="plan")


@pytest.fixture(scope="session")
def gpt_cfg():
    """The planner's config for a 6-block CPU-sized GPT under DDP, its shapes built once on
    the meta device (the first build pays torch's start-up, not the test)."""
    from sharded_exp.compose import compose
    from sharded_exp.plan.depth import shapes_of

    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.n_layers=6", "model.seq_len=8",
             "model.vocab_size=64"]  # fmt: skip
    cfg = compose([*model, "trainer.batch_size=2", "plan.device=cpu"], config_name="plan")
    shapes_of(cfg)
    return cfg
