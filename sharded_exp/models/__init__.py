"""Model registry. A model module registers ``build(cfg) -> nn.Module`` with its schema.

Every model has ``blocks()``, its repeated units (FSDP wraps each one), and takes keyword arguments and returns :class:`ModelOutput` (logits and the loss
when ``targets=`` is given), the way Hugging Face models do; strategies must pass keyword
arguments through their wrappers unchanged.
"""

from typing import NamedTuple

import torch

from sharded_exp.registry import Registry

MODELS = Registry("model")


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


def build_model(cfg) -> torch.nn.Module:
    return MODELS.builder(cfg.name)(cfg)


from sharded_exp.models import gpt, mlp  # noqa: E402,F401  (registers the models)
