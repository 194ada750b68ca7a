"""custom: any ``torch.utils.data.Dataset``, made by a factory of yours.

    python -m sharded_exp model=hf_gpt2 data=custom data._target_=my_pkg.data.build +data.kwargs.n=1000

``data._target_`` names a factory (or a Dataset class) called with ``data.kwargs``; it
returns a map-style Dataset whose items are dicts of tensors: the model's keyword
arguments, labels included. They are batched by ``torch.utils.data.default_collate``
(items of equal shapes), or by the dataset's own ``collate_fn`` attribute when it has one
(padding of your own). A value that is no tensor (a list, a string) reaches the model as
the collation made it: only tensors are copied to the device. What the model's output is
scored by is said by ``data.metric``, ``data.labels`` and, for classification,
``data.num_classes``. Training reads it through the DataLoader of
:mod:`sharded_exp.data.loader` like every file task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch
from hydra.utils import get_object
from omegaconf import MISSING, OmegaConf

from sharded_exp.config import Option, Sealed, bounded
from sharded_exp.data import TASKS, Task
from sharded_exp.data.files import dataset_task
from sharded_exp.errors import ConfigError


class Metric(Option):
    accuracy = "accuracy"
    token_accuracy = "token_accuracy"
    perplexity = "perplexity"


@dataclass
class CustomDataConfig(Sealed):
    name: str = "custom"
    _target_: str = MISSING
    """The factory (or Dataset class), as package.module.name; importable by every rank."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory (``+data.kwargs.n=1000``)."""
    metric: Metric = Metric.perplexity
    """What the model's logits are scored by: accuracy (a class per sample), token_accuracy
    (a class per token, -100 ignored) or perplexity (a language model)."""
    labels: str = "labels"
    """The item key holding the labels."""
    num_classes: int = bounded(0, at_least=0)
    """Classes of a (token) classification task (its metrics need them)."""
    shift_labels: bool = False
    """A causal LM that shifts its labels itself (Hugging Face's form: labels = input_ids)."""
    seed: int = 0
    """Seed of the shuffle (the DistributedSampler's, with the epoch)."""
    shuffle: bool = True
    """Shuffle the samples every epoch (false: the dataset's order)."""
    num_workers: int = bounded(0, at_least=0)
    """DataLoader worker processes per rank (0: batches are made in the rank's process)."""


@TASKS.register("custom", config=CustomDataConfig)
def custom_task(cfg: CustomDataConfig, model_cfg, batch_size: int) -> Task:
    """A user's Dataset, from ``data._target_(**data.kwargs)``."""
    if OmegaConf.is_missing(cfg, "_target_"):
        raise ConfigError("data=custom needs data._target_=package.module.factory (a torch Dataset factory)")
    target = cfg._target_
    try:
        factory = get_object(target)
    except Exception as exc:  # noqa: BLE001 -- Hydra's own complaint, named
        raise ConfigError(f"data._target_={target} cannot be imported ({exc})") from None
    dataset = factory(**OmegaConf.to_container(cfg.kwargs, resolve=True))
    if not isinstance(dataset, torch.utils.data.Dataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"data._target_={target} returned {type(dataset).__name__}, not a map-style torch.utils.data.Dataset "
            "(with __len__ and __getitem__)"
        )
    collate = getattr(dataset, "collate_fn", None) or torch.utils.data.default_collate
    batch = collate([dataset[0]]) if len(dataset) else None
    if batch is not None and (not isinstance(batch, dict) or cfg.labels not in batch):
        raise ConfigError(
            f"data._target_={target}'s batches must be dicts of the model's keyword arguments with the labels "
            f"under data.labels={cfg.labels!r}; a batch of item 0 is {type(batch).__name__}"
            + (f" with keys {', '.join(batch)}" if isinstance(batch, dict) else "")
        )
    metric = str(cfg.metric)
    if metric != "perplexity" and cfg.num_classes < 1:
        raise ConfigError(f"data=custom with data.metric={metric} needs data.num_classes (the number of classes)")
    return dataset_task(
        cfg,
        f"data._target_={target}",
        dataset,
        collate,
        batch_size,
        metric=metric,
        labels=str(cfg.labels),
        num_classes=int(cfg.num_classes),
        shift_labels=bool(cfg.shift_labels),
    )
