"""Synthetic, learnable tasks, generated deterministically from (seed, step, micro-batch, rank).

No files, no downloads: every strategy, world size and rerun sees exactly the same samples
for the same (step, micro-batch, rank), which is what makes parity against DDP meaningful.

Adding a task is one module in this package (a config dataclass and a builder registered
with ``@TASKS.register``; every module here is imported automatically) plus one YAML file
in ``conf/data/``. A builder receives its own config, the model config it must feed and
the per-rank batch size; it returns a callable ``batch(step, micro, rank) -> dict`` of
keyword arguments for the model. A task says which model fields it reads
(:func:`require_model_fields`), never which model names it accepts.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import torch

from sharded_exp.errors import ConfigError
from sharded_exp.registry import Registry

TASKS = Registry("data")

Batch = dict[str, torch.Tensor]


def generator(seed: int, *keys: int) -> torch.Generator:
    """A distinct, reproducible stream per (seed, step, micro, rank); the mix keeps nearby
    keys from producing correlated streams."""
    g = torch.Generator()
    mixed = seed
    for k in keys:
        mixed = (mixed * 1_000_003 + k + 1) % (2**62)
    g.manual_seed(mixed)
    return g


def require_model_fields(task: str, feeds: str, model_cfg, fields: tuple[str, ...]) -> None:
    """Refuse a model whose config lacks the fields this task sizes its samples by."""
    missing = [f for f in fields if f not in model_cfg]
    if missing:
        raise ConfigError(
            f"data={task} feeds {feeds}, not model={model_cfg.name}: it needs "
            + ", ".join(f"model.{f}" for f in fields)
            + f" (model={model_cfg.name} has no {', '.join(missing)})"
        )


def build_task(cfg, model_cfg, batch_size: int) -> Callable[..., Batch]:
    return TASKS.builder(cfg.name)(cfg, model_cfg, batch_size)


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
