"""Model registry. A model module registers ``build(cfg) -> nn.Module`` with its schema.

Adding a model is one module in this package (a config dataclass and a builder registered
with ``@MODELS.register``; every module here is imported automatically) plus one YAML file
in ``conf/model/`` whose defaults list names the data task that feeds it.

Every model has ``blocks()``, its repeated units (FSDP wraps each one), and takes keyword
arguments and returns :class:`ModelOutput` (logits and the loss when ``targets=`` is
given), the way Hugging Face models do; strategies must pass keyword arguments through
their wrappers unchanged.
"""

import importlib
import pkgutil
from typing import NamedTuple

import torch

from sharded_exp.registry import Registry

MODELS = Registry("model")


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


def build_model(cfg) -> torch.nn.Module:
    return MODELS.builder(cfg.name)(cfg)


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
