"""Synthetic, learnable tasks, generated deterministically from (seed, step, micro-batch, rank).

No files, no downloads: every strategy, world size and rerun sees exactly the same samples
for the same (step, micro-batch, rank), which is what makes parity against DDP meaningful.

Adding a task is one module in this package (a config dataclass and a builder registered
with ``@TASKS.register``; every module here is imported automatically) plus one YAML file
in ``conf/data/``. A builder receives its own config, the model config it must feed and
the per-rank batch size; it returns a :class:`Task`: ``batch(step, micro, rank) -> dict``
of keyword arguments for the model, and what the model's output is scored by (the
training and evaluation metrics come from the task, not from a tensor's shape). A task
says which model fields it reads (:func:`require_model_fields`), never which model names
it accepts.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from sharded_exp.registry import Registry

TASKS = Registry("data")

Batch = dict[str, torch.Tensor]


def each_tensor(batch: dict, move: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """``batch`` with ``move`` (a copy to the device) applied to its tensors; other values
    (a list of strings, a flag) pass unchanged: a user's dataset may carry them for a model
    that takes them."""
    return {k: move(v) if torch.is_tensor(v) else v for k, v in batch.items()}


def generator(seed: int, *keys: int) -> torch.Generator:
    """A distinct, reproducible stream per (seed, step, micro, rank); the mix keeps nearby
    keys from producing correlated streams."""
    g = torch.Generator()
    mixed = seed
    for k in keys:
        mixed = (mixed * 1_000_003 + k + 1) % (2**62)
    g.manual_seed(mixed)
    return g


@dataclass
class Task:
    """A data task as the trainer uses it: batches, and what the model's output is scored by.

    Calling it is calling ``batch(step, micro, rank)``: the model's keyword arguments.
    """

    batch: Callable[[int, int, int], Batch]
    metric: str
    """accuracy (classification), token_accuracy (token classification) or perplexity (LM)."""
    labels: str = "targets"
    """The batch key holding the labels (``targets`` for our models, ``labels`` for Hugging Face's)."""
    num_classes: int = 0
    """Classes of a classification task (its metrics need them)."""
    shift_labels: bool = False
    """Causal LM in Hugging Face's form: the model predicts labels[:, 1:] from logits[:, :-1]."""
    padded: bool = True
    """Whether a batch's ``attention_mask`` may hold zeros (padding). False where every token
    of every batch is attended (causal-LM blocks of ``model.seq_len`` tokens): a Hugging Face
    model then calls SDPA causal without a mask, and the fake step, which cannot read the
    mask's values, is told so (:func:`sharded_exp.predict.fake_step.unpadded_masks`). True
    (the default, and a user's dataset's): the mask may pad, as transformers assumes when it
    cannot read it."""
    dataset: Any = None
    """A map-style ``torch.utils.data.Dataset`` (a user's data): when set, training batches come
    from a DataLoader over it, each rank its own shard (:mod:`sharded_exp.data.loader`), and
    ``batch`` serves only evaluation and the shape probes."""
    collate: Callable | None = None
    """Makes a batch of a list of the dataset's items (padding is the task's)."""
    seed: int = 0
    """Seed of the DataLoader's shuffle (DistributedSampler's, with the epoch)."""
    shuffle: bool = True
    """Shuffle the dataset every epoch (False: file order)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: batches are made in the rank's process)."""
    fingerprint: dict[str, str] | None = None
    """What the dataset was read from: ``path`` and ``content`` (a hash, or size and time).
    A checkpoint's data position records it, so that a resume on other data is told (None:
    a user's factory, whose data only its length tells)."""

    def __call__(self, step: int, micro: int, rank: int) -> Batch:
        return self.batch(step, micro, rank)

    @staticmethod
    def loss_of(output) -> torch.Tensor:
        """The loss of a model's output: an object or a dict with ``loss`` (the contract)."""
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None:
            raise ContractError(
                f"the model returned {type(output).__name__} without a loss: it must return an object or a dict "
                "with `loss` (and `logits` for the metrics), computed from the batch's labels"
            )
        return loss

    @staticmethod
    def logits_of(output) -> torch.Tensor | None:
        """The logits of a model's output (an object or a dict), if it has them."""
        return output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)

    def predictions(self, output, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, labels), aligned for the metrics."""
        logits = self.logits_of(output)
        if logits is None:
            raise ContractError("the model returned no `logits`: the training metrics need them")
        labels = batch[self.labels]
        if self.shift_labels:
            return logits[:, :-1], labels[:, 1:]
        return logits, labels


class ContractError(RuntimeError):
    """A model that breaks the contract (keyword batch in; ``loss`` and ``logits`` out)."""


def build_task(cfg, model_cfg, batch_size: int) -> Task:
    return TASKS.builder(cfg.name)(cfg, model_cfg, batch_size)


STAND_INS = {"text_file": "causal_lm", "conll": "token_classification"}
"""A user's data task -> the synthetic task whose batches have the same keys and shapes."""


def probe_task(cfg, model_cfg) -> Task:
    """The configured task at one sample a batch, for the fake step: its batches' keys, dtypes
    and per-sample shapes, and whether they pad (:attr:`Task.padded`). The planner needs
    shapes only: a user's data whose ``data.path`` is not given is stood in for by the
    synthetic task of the same layout (padded to model.seq_len)."""
    name = cfg.name
    if "path" in cfg.keys() and OmegaConf.is_missing(cfg, "path"):  # keys(): also a missing value
        kind = str(cfg.get("kind"))
        stand_in = STAND_INS.get(name) or (kind if name == "hf_dataset" else None)
        if stand_in is not None:
            return TASKS.builder(stand_in)(TASKS.config_class(stand_in)(), model_cfg, 1)
    return build_task(cfg, model_cfg, 1)


def probe_batch(cfg, model_cfg, rank: int) -> Batch:
    """One sample of the configured task (:func:`probe_task`'s) for ``rank``."""
    return probe_task(cfg, model_cfg)(0, 0, rank)


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
