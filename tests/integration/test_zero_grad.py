"""trainer.zero_grad: how each step clears the last step's gradients (free: set_to_none=True;
zeros: set_to_none=False, torch's behaviour before 2.0), applied by the strategy wherever it
allows it, recorded where it does not, and faked the same way by the memory prediction."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.compose import compose
from sharded_exp.config import ZeroGrad
from tests.helpers.jobs import STRATEGY_NAMES, tiny


def _stepped(overrides: list[str]):
    """A run built in this process (one rank), after two steps and the next step's zero_grad:
    the gradients as the next forward finds them."""
    from sharded_exp.train.build import build_run
    from sharded_exp.train.step import train_step

    run = build_run(compose(tiny(overrides)), torch.device("cpu"))
    for step in range(2):
        train_step(run.strategy, [run.task(step, 0, 0)], run.autocast, 1.0)
    run.strategy.zero_grad()
    return run


def test_zeros_keeps_gradients_as_zero_tensors_and_free_drops_them(gloo_group):
    zeros = _stepped(["strategy=ddp", "trainer.zero_grad=zeros"])
    grads = [p.grad for p in zeros.module.parameters()]
    assert all(g is not None and g.shape == p.shape and not g.any() for g, p in zip(grads, zeros.module.parameters()))
    assert zeros.strategy.grad_zeroing.applied is ZeroGrad.zeros and not zeros.strategy.grad_zeroing.reason
    free = _stepped(["strategy=ddp"])  # the default
    assert all(p.grad is None for p in free.module.parameters())
    assert free.strategy.grad_zeroing.record() == {"requested": "free", "applied": "free", "reason": None}


def test_sharded_ddp_zeroes_in_place_and_says_that_free_is_not_honoured(gloo_group):
    run = _stepped(["strategy=sharded_ddp"])  # trainer.zero_grad=free, the default
    assert all(p.grad is not None and not p.grad.any() for p in run.module.parameters())
    record = run.strategy.grad_zeroing.record()
    assert record["requested"] == "free" and record["applied"] == "zeros"
    assert "ShardedDataParallel computes wrong gradients" in record["reason"]


def test_the_parent_decides_and_records_the_rule_the_strategy_applies(tmp_path):
    from sharded_exp.launch import preflight
    from sharded_exp.strategies import STRATEGIES

    for name in STRATEGY_NAMES:  # the shipped ones (a test may register broken ones beside them)
        fixed = STRATEGIES.builder(name).traits.zero_grad_fixed
        for asked in ZeroGrad:
            cfg = compose(tiny([f"strategy={name}", f"trainer.zero_grad={asked.value}"]))
            rule = preflight.check(cfg, str(tmp_path), peak=False).zero_grad
            assert rule.requested is asked and rule.applied is (fixed or asked)
            assert bool(rule.reason) == (rule.applied is not asked)


def test_the_fake_step_holds_zeroed_gradients_through_the_forward():
    """With zeros, the second step's forward runs beside the whole gradients; freed, beside
    none: the predicted peak counts them (DDP, a model whose peak is in its forward)."""
    from sharded_exp.predict.prediction import model_shapes, predict, predict_peak

    peaks = {}
    for rule in ZeroGrad:
        cfg = compose(["model=hf_bert", "model.seq_len=32", "trainer.batch_size=8", f"trainer.zero_grad={rule.value}"])
        shapes = model_shapes(cfg.model, cfg.optimizer)
        prediction = predict(cfg.strategy, cfg.optimizer, "32", shapes, 2)
        peaks[rule] = predict_peak(cfg, 2, "cpu", prediction, shapes, flops=False)
    grads = prediction["model_states_mib"][0]["grads"]
    free, zeros = peaks[ZeroGrad.free], peaks[ZeroGrad.zeros]
    assert free["breakdown_mib"]["grads"] < 0.01 * grads  # freed: none alive at the forward's peak
    assert zeros["breakdown_mib"]["grads"] == pytest.approx(grads, rel=1e-6)
    extra = grads - free["breakdown_mib"]["grads"]  # (freed: the head's first gradients, made at the peak)
    assert max(zeros["per_rank_mib"]) - max(free["per_rank_mib"]) == pytest.approx(extra, rel=1e-6)
