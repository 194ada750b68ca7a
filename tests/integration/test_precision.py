"""Mixed precision on every strategy, and the one-rank inf gradient at precision=16.

The inf is written into the gradient of a parameter of rank 1's own optimizer shard,
before any communication (SHARDED_EXP_FAULT=...,kind=inf_grad). With sharded gradients
only rank 1 then sees it: every rank must still skip that step and lower its scale.
"""

from __future__ import annotations

import pytest

from tests.helpers.jobs import STRATEGY_NAMES, launch_job

SHARDS_PARAMS = ("fsdp", "fsdp_grad_op")
INF_AT = {"SHARDED_EXP_FAULT": "rank=1,step=2,kind=inf_grad"}


@pytest.mark.parametrize(
    "strategy",
    # Without reduce buckets ShardedDDP frees the gradients a rank does not own, so the
    # inf is truly in rank 1's shard only (with buckets, gloo leaves partial sums behind).
    [*STRATEGY_NAMES, "sharded_ddp strategy.reduce_buffer_size=0"],
)
def test_one_rank_inf_skips_the_step_on_every_rank(strategy, tmp_path):
    overrides = [f"strategy={strategy.split()[0]}", *strategy.split()[1:], "precision=16", "trainer.steps=4"]
    result = launch_job(overrides, tmp_path, env=INF_AT)
    assert result["status"] == "ok", result.get("error")
    ranks = result["memory"]["per_rank"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["skipped_steps"] == 1, r
        assert r["loss_scale"] == 65536.0 * 0.5, r  # backoff applied exactly once
        assert r["nonfinite_params"] == 0, r
    if overrides[0].split("=")[1] not in SHARDS_PARAMS:
        # Same parameters on both ranks afterwards: nobody stepped alone.
        assert ranks[0]["local_param_digest"] == ranks[1]["local_param_digest"]


@pytest.mark.slow
def test_plain_scaler_under_sharded_gradients_desyncs(tmp_path):
    """Negative control: without an agreed found-inf flag, rank 1 skips the step alone.

    Rank 0 then waits in OSS's parameter broadcast for a rank that never sends: the
    collective timeout ends the job instead of a silent desync or a hang.
    """
    overrides = [
        "strategy=sharded_ddp",
        "strategy.name=sharded_ddp_plain_scaler",
        "strategy.reduce_buffer_size=0",
        "precision=16",
        "trainer.steps=4",
        "trainer.timeout_s=8",
    ]
    env = {**INF_AT, "SHARDED_EXP_PLUGINS": "tests.helpers.broken_strategies"}
    result = launch_job(overrides, tmp_path, env=env)
    ranks = (result.get("memory") or {}).get("per_rank") or []
    assert result["status"] == "failed" or ranks[0]["skipped_steps"] != ranks[1]["skipped_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("precision", ["16", "bf16"])
def test_half_precision_trains(strategy, precision, tmp_path):
    result = launch_job(
        [f"strategy={strategy}", f"precision={precision}", "trainer.steps=12", "trainer.log_interval=4"], tmp_path
    )
    assert result["status"] == "ok", result.get("error")
    assert result["precision"] == precision
    assert all(r["nonfinite_params"] == 0 for r in result["memory"]["per_rank"])
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
