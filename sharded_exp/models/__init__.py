"""Model registry. A model module registers ``build(cfg) -> nn.Module`` with its schema.

Adding a model is one module in this package (a config dataclass and a builder registered
with ``@MODELS.register``; every module here is imported automatically) plus one YAML file
in ``conf/model/`` whose defaults list names the data task that feeds it.

Every model has ``sharding_units()``, its repeated units (FSDP wraps each one), and takes keyword
arguments and returns :class:`ModelOutput` (logits and the loss when ``targets=`` is
given), the way Hugging Face models do; strategies must pass keyword arguments through
their wrappers unchanged.
"""

import fnmatch
import importlib
import pkgutil
from typing import NamedTuple

import torch

from sharded_exp.config_file import is_target_model
from sharded_exp.errors import ConfigError
from sharded_exp.models.target import build_target_model
from sharded_exp.registry import Registry

MODELS = Registry("model")


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


def build_model(cfg, freeze=(), weights: bool = False) -> torch.nn.Module:
    """The configured model: a registered builder, or a ``_target_`` (Hugging Face class or a
    user's factory, :mod:`sharded_exp.models.target`); parameters named by the ``freeze``
    patterns are frozen (:func:`freeze_parameters`). ``weights``: load ``model.pretrained``'s
    weights (when it is set); without, the model is only built from its config."""
    module = build_target_model(cfg, weights) if is_target_model(cfg) else MODELS.builder(cfg.name)(cfg)
    if freeze:
        freeze_parameters(module, freeze)
    return module


def freeze_parameters(module: torch.nn.Module, patterns) -> list[str]:
    """Set ``requires_grad=False`` on the parameters whose names match one of the shell
    ``patterns`` (fnmatch); returns their names. Raises ConfigError, naming the parameters
    there are, when a pattern matches none (a typo would otherwise train everything)."""
    names = [n for n, _ in module.named_parameters()]
    frozen = []
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
            raise ConfigError(f"trainer.freeze pattern {pattern!r} matches no parameter; the model's are: {shown}")
        frozen.extend(h for h in hits if h not in frozen)
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return frozen


UNITS_HOOK = "sharding_units"
"""The method by which a model names its repeated units itself (ours do). A name no common
model uses for anything else: ``blocks`` and ``layers`` are usually a ModuleList."""


def units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated units (what FSDP wraps one by one and the memory model gathers):
    its ``sharding_units()`` if it defines that method; else the modules Hugging Face names in
    ``_no_split_modules``; else the children of its longest ModuleList, or Sequential of
    repeated blocks (``self.blocks = nn.ModuleList(...)``, timm's ``nn.Sequential`` of
    blocks, nanoGPT's ``transformer.h``). Units never nest."""
    if callable(getattr(type(module), UNITS_HOOK, None)):
        return list(getattr(module, UNITS_HOOK)())
    names = set(getattr(module, "_no_split_modules", None) or [])
    found: list[torch.nn.Module] = []
    if names:
        for sub in module.modules():
            if sub is not module and type(sub).__name__ in names and not any(_contains(u, sub) for u in found):
                found.append(sub)
        if found:
            return found
    lists = [m for m in module.modules() if m is not module and (isinstance(m, torch.nn.ModuleList) or _blocks(m))]
    return list(max(lists, key=len)) if lists else []


def _blocks(module: torch.nn.Module) -> bool:
    """A Sequential of repeated blocks (timm's ``blocks``): two or more children, all of one
    type, each with parameters; not a layer's own Linear-activation-Linear."""
    children = list(module.children())
    return (
        isinstance(module, torch.nn.Sequential)
        and len(children) > 1
        and len({type(c) for c in children}) == 1
        and all(any(True for _ in c.parameters()) for c in children)
    )


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
