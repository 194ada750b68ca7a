"""One optimizer step, the same in a real run, a fake step and a benchmark.

zero the gradients, for each micro-batch: autocast forward and loss, scaled backward
(gradients communicated on the last one only); unscale and clip; step through the scaler.
The step never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib

import torch

from sharded_exp.data import ContractError, Task
from sharded_exp.strategies.base import Strategy


def train_step(strategy: Strategy, batches: list[dict[str, torch.Tensor]], autocast, grad_clip: float):
    """One optimizer step over ``len(batches)`` micro-batches; returns (loss, ``{"logits":
    the last micro-batch's logits, detached}``)."""
    strategy.zero_grad()
    n, total = len(batches), None
    for i, batch in enumerate(batches):
        # Gradients are communicated on the last micro-batch only.
        with contextlib.nullcontext() if i == n - 1 else strategy.no_sync():
            with autocast:
                out = strategy.model(**batch)
                try:
                    loss = Task.loss_of(out)
                except ContractError as exc:  # say what it was called with
                    raise ContractError(f"{exc}; it was called with the batch keys {', '.join(batch)}") from None
                if n > 1:  # no op for nothing: a small model's step has no time to spare
                    loss = loss / n
            strategy.scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    # What the metrics need of the output, detached: the autograd graph goes here, in the
    # step (as in any loop), not later wherever the last reference happens to die.
    logits = Task.logits_of(out)
    out = {"logits": None if logits is None else logits.detach()}
    if grad_clip > 0:
        strategy.scaler.unscale_(strategy.optimizer)  # clip the true gradients, not scaled ones
        strategy.clip_grad_norm_(grad_clip)
    strategy.optimizer_step()
    return total, out
