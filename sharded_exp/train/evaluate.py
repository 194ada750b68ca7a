"""The evaluation pass: untimed, on held-out batches, with torchmetrics.

Every ``trainer.eval_every`` steps (0: only at the end) and at the end of training, each
rank runs ``trainer.eval_batches`` batches of a sample stream the training never sees
(steps from :data:`EVAL_STEP` on) through the wrapped model without gradients, and the
task's ``MetricCollection`` is computed once: one sync of its states over the ranks
(torchmetrics' own, blocking; it runs outside the timed steps and the memory window).
"""

from __future__ import annotations

from typing import Any

import torch

from sharded_exp.data import Task, each_tensor

EVAL_STEP = 1_000_000_000
"""Held-out batches are those of steps EVAL_STEP, EVAL_STEP + 1, ...: a stream of their own."""


def task_metrics(task: Task):
    """The torchmetrics collection of a task (metric names without the ``eval/`` prefix)."""
    # lazy: torchmetrics takes seconds to import; only a run that evaluates (trainer.eval_batches > 0) needs it
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
    from torchmetrics.text import Perplexity

    if task.metric == "token_accuracy":
        n = task.num_classes
        return MetricCollection(
            {
                # micro: the share of (non-padding) tokens labelled right; macro F1 over the labels,
                # what the seed's NER script reported
                "accuracy": MulticlassAccuracy(n, average="micro", ignore_index=-100, validate_args=False),
                "f1": MulticlassF1Score(n, average="macro", ignore_index=-100, validate_args=False),
            }
        )
    if task.metric == "accuracy":
        return MetricCollection(
            {"accuracy": MulticlassAccuracy(task.num_classes, average="micro", validate_args=False)}
        )
    return MetricCollection({"perplexity": Perplexity(ignore_index=-100)})


def evaluate(strategy, task: Task, autocast, device: torch.device, batches: int, rank: int) -> dict[str, Any]:
    """Collective: every rank runs its share of held-out batches; returns ``eval/*`` values."""
    from torchmetrics import MeanMetric  # lazy: as in task_metrics

    metrics = task_metrics(task).to(device)
    loss = MeanMetric().to(device)
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
                if task.metric == "perplexity":
                    metrics.update(logits.float(), labels)
                else:
                    metrics.update(logits.float().argmax(-1), labels)
                loss.update(task.loss_of(out).float())
        values = {f"eval/{k}": float(v) for k, v in metrics.compute().items()}
        values["eval/loss"] = float(loss.compute())
    finally:
        model.train(was_training)
    return values
