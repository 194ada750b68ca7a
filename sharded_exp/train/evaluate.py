"""The evaluation pass: untimed, on held-out batches, with torchmetrics' definitions in plain torch.

Every ``trainer.eval_every`` steps (0: only at the end) and at the end of training, each
rank runs ``trainer.eval_batches`` batches of a sample stream the training never sees
(steps from :data:`EVAL_STEP` on) through the wrapped model without gradients. Each rank
adds up what the task's metrics need (:class:`Sums`); one collective of those few numbers
over the ranks, outside the timed steps and the memory window, gives the values.

The metrics are torchmetrics' (``MulticlassAccuracy`` micro, ``MulticlassF1Score`` macro,
``Perplexity``, ``MeanMetric``), computed with the same arithmetic so they give the same
float32 values, but not by torchmetrics: importing any of it runs its package ``__init__``,
which imports every domain and with them scipy, transformers and matplotlib, seconds of CPU
in every rank (docs/figures.md). tests/unit/train/test_evaluate.py holds each against it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sharded_exp.data import Task, each_tensor
from sharded_exp.train import kept_works

EVAL_STEP = 1_000_000_000
"""Held-out batches are those of steps EVAL_STEP, EVAL_STEP + 1, ...: a stream of their own."""

IGNORE_INDEX = -100
"""The label of a position that is not scored (padding, a shifted-out token): torch's and
Hugging Face's convention, and what torchmetrics is told (``ignore_index=-100``)."""

METRICS = {"token_accuracy": ("accuracy", "f1"), "accuracy": ("accuracy",), "perplexity": ("perplexity",)}
"""The ``eval/`` metrics of each ``Task.metric`` (besides ``loss``, which every task has)."""


class Sums:
    """One rank's running sums for a task's metrics, then their values over all ranks.

    Each state has torchmetrics' dtype and is added to as torchmetrics adds to it, so the
    values match its own to the last bit: int64 counts, float32 sums (a batch's sum first,
    then added to the state), summed over the ranks in rank order (its ``all_gather``, then
    ``stack(...).sum(0)``).
    """

    def __init__(self, metric: str, num_classes: int = 0, device: torch.device | str = "cpu"):
        if metric not in METRICS:
            raise ValueError(f"no evaluation metrics for task metric {metric!r}; known: {sorted(METRICS)}")
        if metric != "perplexity" and num_classes < 1:
            raise ValueError(f"task metric {metric!r} needs num_classes >= 1, got {num_classes}")
        self.metric, self.num_classes = metric, num_classes
        # a classifier's labels are all scored (torchmetrics was given no ignore_index for it)
        self.ignore_index = None if metric == "accuracy" else IGNORE_INDEX
        f32 = dict(dtype=torch.float32, device=device)
        self.state: dict[str, torch.Tensor] = {"loss_sum": torch.zeros((), **f32), "loss_count": torch.zeros((), **f32)}
        if metric == "perplexity":
            self.state |= {"nll_sum": torch.zeros((), **f32), "tokens": torch.zeros((), **f32)}
            return
        i64 = dict(dtype=torch.int64, device=device)
        self.state |= {"right": torch.zeros((), **i64), "counted": torch.zeros((), **i64)}
        if "f1" in METRICS[metric]:  # per class: labelled right, predicted, labelled
            self.state |= {k: torch.zeros((num_classes,), **i64) for k in ("tp", "predicted", "actual")}

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        """Add one batch: its float logits ``(..., classes)``, labels ``(...)`` and scalar loss."""
        s = self.state
        loss = loss.detach().float().reshape(())
        if not torch.isnan(loss):  # MeanMetric's default nan_strategy leaves a NaN value out (with a warning)
            s["loss_sum"] += loss
            s["loss_count"] += 1.0
        labels = labels.reshape(-1)
        if self.metric == "perplexity":
            # Perplexity's update as it is: the softmax's probability of the label, then its log
            probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=1)
            scored = labels != IGNORE_INDEX
            picked = probs[torch.arange(labels.numel(), device=labels.device), labels.where(scored, 0)][scored]
            s["nll_sum"] += -picked.log().sum()
            s["tokens"] += scored.sum()
            return
        preds = logits.argmax(-1).reshape(-1)
        if self.ignore_index is not None:
            scored = labels != self.ignore_index
            preds, labels = preds[scored], labels[scored]
        hit = preds == labels
        s["right"] += hit.sum()
        s["counted"] += labels.numel()
        if "tp" in s:
            n = self.num_classes
            if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < n:
                raise ValueError(
                    f"labels from {int(labels.min())} to {int(labels.max())}: a {n}-class task takes 0..{n - 1} "
                    f"and {IGNORE_INDEX} (not scored)"
                )
            s["tp"] += torch.bincount(labels[hit], minlength=n)
            s["predicted"] += torch.bincount(preds, minlength=n)
            s["actual"] += torch.bincount(labels, minlength=n)

    def total(self) -> dict[str, torch.Tensor]:
        """The states summed over the ranks of the default process group (this rank's alone without one).

        Collective: every rank calls it. One ``all_gather`` of the states packed in float64
        (float32 values and int64 counts below 2**53 travel exactly), unpacked to their own dtypes.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return dict(self.state)
        names = list(self.state)
        packed = torch.cat([self.state[k].reshape(-1).double() for k in names])
        gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size())]
        # kept: the final evaluation's gather is often a run's last collective (kept_works)
        kept_works.keep(dist.all_gather(gathered, packed, async_op=True)).wait()
        sizes = [self.state[k].numel() for k in names]
        return add_ranks(
            [{k: part.to(self.state[k].dtype).reshape(self.state[k].shape)
              for k, part in zip(names, g.split(sizes))} for g in gathered]
        )  # fmt: skip

    def compute(self) -> dict[str, float]:
        """``{"eval/<metric>": value}`` over all ranks (collective)."""
        return self.values(self.total())

    def values(self, s: dict[str, torch.Tensor]) -> dict[str, float]:
        """``{"eval/<metric>": value}`` of states summed over the ranks (the task's metrics, then the loss)."""
        if self.metric == "perplexity":
            values = {"eval/perplexity": float(torch.exp(s["nll_sum"] / s["tokens"]))}
        else:
            values = {"eval/accuracy": float(_safe_divide(s["right"], s["counted"]))}  # micro: right / counted
        if "tp" in s:
            tp = s["tp"]
            fp, fn = s["predicted"] - tp, s["actual"] - tp
            f1 = _safe_divide(2.0 * tp, 2.0 * tp + 1.0 * fn + fp)
            # macro over the classes that occur (as a label or a prediction): _adjust_weights_safe_divide
            weights = torch.ones_like(f1)
            weights[tp + fp + fn == 0] = 0.0
            values["eval/f1"] = float(_safe_divide(weights * f1, weights.sum(-1, keepdim=True)).sum(-1))
        values["eval/loss"] = float(s["loss_sum"] / s["loss_count"])  # MeanMetric: each batch weighted 1
        return values


def add_ranks(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each state summed over the ranks' states, in rank order and in its own dtype: torchmetrics'
    sync (its gathered states stacked, then ``sum(0)``), so float32 sums round as its do."""
    return {k: torch.stack([state[k] for state in states]).sum(0) for k in states[0]}


def _safe_divide(num: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """num / denom in float32 (integers converted), 0 where denom is 0: torchmetrics' zero division."""
    num = num if num.is_floating_point() else num.float()
    denom = denom if denom.is_floating_point() else denom.float()
    return torch.where(denom != 0, num / denom, torch.zeros((), dtype=num.dtype, device=num.device))


def evaluate(strategy, task: Task, autocast, device: torch.device, batches: int, rank: int) -> dict[str, Any]:
    """Collective: every rank runs its share of held-out batches; returns ``eval/*`` values."""
    sums = Sums(task.metric, task.num_classes, device)
    model = strategy.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(batches):
                batch = each_tensor(task.batch(EVAL_STEP + i, 0, rank), lambda v: v.to(device))
                with autocast:
                    out = model(**batch)
                logits, labels = task.predictions(out, batch)
                sums.update(logits.float(), labels, task.loss_of(out))
        values = sums.compute()
    finally:
        model.train(was_training)
    return values
