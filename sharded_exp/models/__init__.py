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
    """The configured model: a registered builder, or a ``_target_`` (Hugging Face class or a
    user's factory, :mod:`sharded_exp.models.target`)."""
    from sharded_exp.models.target import build_target_model, is_target_model

    if is_target_model(cfg):
        return build_target_model(cfg)
    return MODELS.builder(cfg.name)(cfg)


def units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated units (what FSDP wraps one by one and the memory model gathers):
    its ``blocks()`` if it has them; else the modules Hugging Face names in
    ``_no_split_modules``; else the children of its longest ModuleList. Units never nest."""
    if hasattr(module, "blocks"):
        return list(module.blocks())
    names = set(getattr(module, "_no_split_modules", None) or [])
    found: list[torch.nn.Module] = []
    if names:
        for sub in module.modules():
            if sub is not module and type(sub).__name__ in names and not any(_contains(u, sub) for u in found):
                found.append(sub)
        if found:
            return found
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
