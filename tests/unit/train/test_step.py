"""sharded_exp.train.step.train_step: one optimizer step over micro-batches, under the base
Strategy (no wrapper): gradients communicated on the last micro-batch only, the loss
averaged over micro-batches, clipping of unscaled gradients, detached logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded_exp.data import ContractError
from sharded_exp.train.step import train_step
from tests.helpers.unit_train import PlainStrategy, TinyClassifier, batch

NO_AUTOCAST = torch.autocast("cpu", enabled=False)


def test_one_micro_batch_steps_once_on_its_loss():
    strategy = PlainStrategy(TinyClassifier(), lr=0.1)
    w = strategy.module.fc.weight.detach().clone()
    b = batch(0, 0, 0)
    loss, out = train_step(strategy, [b], NO_AUTOCAST, grad_clip=0.0)
    # independently: the loss and SGD's update from a fresh copy of the same model
    ref = TinyClassifier()
    ref_loss = F.cross_entropy(ref.fc(b["inputs"]), b["targets"])
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item())
    assert torch.allclose(strategy.module.fc.weight, w - 0.1 * ref.fc.weight.grad)
    assert strategy.no_sync_entries == 0  # one micro-batch: it communicates


def test_micro_batches_average_their_losses_and_sync_on_the_last_only():
    strategy = PlainStrategy(TinyClassifier())
    model, inside = strategy.model, []

    def forward(**b):
        inside.append(strategy.in_no_sync)
        return model(**b)

    strategy.model = forward
    batches = [batch(0, m, 0) for m in range(3)]
    ref = TinyClassifier()
    expected = sum(F.cross_entropy(ref.fc(b["inputs"]), b["targets"]).item() for b in batches) / 3
    loss, _ = train_step(strategy, batches, NO_AUTOCAST, grad_clip=0.0)
    assert loss.item() == pytest.approx(expected)
    assert inside == [True, True, False]  # gradients are communicated on the last micro-batch only


def test_the_accumulated_gradient_is_that_of_the_mean_loss():
    strategy = PlainStrategy(TinyClassifier(), lr=1.0)
    batches = [batch(1, m, 0) for m in range(2)]
    w = strategy.module.fc.weight.detach().clone()
    train_step(strategy, batches, NO_AUTOCAST, grad_clip=0.0)
    ref = TinyClassifier()
    sum(F.cross_entropy(ref.fc(b["inputs"]), b["targets"]) for b in batches).div(2).backward()
    assert torch.allclose(strategy.module.fc.weight, w - ref.fc.weight.grad, atol=1e-6)


def test_gradients_are_zeroed_before_the_step():
    strategy = PlainStrategy(TinyClassifier(), lr=0.0)
    for p in strategy.module.parameters():
        p.grad = torch.full_like(p, 100.0)  # stale: must not be added to
    train_step(strategy, [batch(0, 0, 0)], NO_AUTOCAST, grad_clip=0.0)
    assert strategy.module.fc.weight.grad.abs().max() < 100.0


def test_the_step_returns_the_last_micro_batchs_logits_detached():
    strategy = PlainStrategy(TinyClassifier())
    batches = [batch(0, m, 0) for m in range(2)]
    _, out = train_step(strategy, batches, NO_AUTOCAST, grad_clip=0.0)
    assert out["logits"].shape == (8, 3) and not out["logits"].requires_grad
    ref = TinyClassifier()
    assert torch.allclose(out["logits"], ref.fc(batches[1]["inputs"]).detach())


def test_clipping_bounds_the_gradient_norm_and_is_off_at_zero():
    clipped = PlainStrategy(TinyClassifier())
    train_step(clipped, [batch(0, 0, 0)], NO_AUTOCAST, grad_clip=1e-3)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in clipped.module.parameters()]))
    assert norm.item() == pytest.approx(1e-3, rel=1e-3)
    free = PlainStrategy(TinyClassifier())
    train_step(free, [batch(0, 0, 0)], NO_AUTOCAST, grad_clip=0.0)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in free.module.parameters()]))
    assert norm.item() > 1e-2


def test_a_model_without_a_loss_is_told_which_batch_keys_it_got():
    strategy = PlainStrategy(TinyClassifier())
    strategy.model = lambda **batch: {"logits": torch.zeros(1)}
    with pytest.raises(ContractError, match="called with the batch keys inputs, targets"):
        train_step(strategy, [batch(0, 0, 0)], NO_AUTOCAST, grad_clip=0.0)
