"""Strategy registry: how a model and its optimizer are wrapped for data-parallel training.

Adding a strategy is one module in this package (a :class:`~.base.Strategy` subclass with
its ``Config`` dataclass, its ``traits`` and its ``memory`` model, registered with
``@STRATEGIES.register``) plus one YAML file in ``conf/strategy/``; every module here is
imported automatically. A strategy that needs a package we do not depend on names it in its
config class's ``REQUIRES`` (which its ``traits.requires`` takes) and imports it inside
``build``, so the others run without it (checked on the command line and before any rank
starts, :func:`sharded_exp.config.check_packages`).

Everything outside this package asks these functions about strategies (their order, the
baseline, the one a user's wrappers show) and never spells a strategy's name.
"""

import importlib
import pkgutil

from sharded_exp.config import ZeroGrad
from sharded_exp.errors import ConfigError
from sharded_exp.registry import Registry
from sharded_exp.strategies.residency import MemoryModel
from sharded_exp.strategies.timing import TimeModel
from sharded_exp.strategies.traits import Traits, defines, wrapped_by

STRATEGIES = Registry("strategy")


def traits_of(name: str) -> Traits:
    """The frozen facts of the registered strategy ``name`` (raises ConfigError naming the
    registered ones when there is none)."""
    return STRATEGIES.builder(name).traits


def memory_of(name: str) -> type[MemoryModel]:
    """The memory model of the registered strategy ``name``."""
    return STRATEGIES.builder(name).memory


def timing_of(name: str) -> type[TimeModel]:
    """The time model of the registered strategy ``name``."""
    return STRATEGIES.builder(name).timing


def sharding_order(name: str) -> tuple[int, str]:
    """Where ``name`` stands from the least sharded strategy to the most (``Traits.sharding``),
    by name among equals; a name not registered (a plugin's point of an older sweep) last."""
    try:
        return traits_of(name).sharding, name
    except ConfigError:
        return 99, name


def by_sharding(names) -> list[str]:
    """``names`` from the least sharded strategy to the most (:func:`sharding_order`)."""
    return sorted(names, key=sharding_order)


def baseline() -> str:
    """The name of the strategy every other one is compared with (``Traits.baseline``: DDP)."""
    return next(name for name in STRATEGIES.names() if traits_of(name).baseline)


def offloads_to_host(strategy_cfg) -> bool:
    """Does the strategy ``strategy_cfg`` configures keep model states in host memory?"""
    return traits_of(strategy_cfg.name).offloads_to_host(strategy_cfg)


def name_of_wrapper(model, optimizer=None) -> tuple[str | None, str | None]:
    """The registered strategy whose wrappers (``Traits.wrappers``) are on ``model`` (it or any
    module inside it) or ``optimizer``, the most sharded one where several are (OSS runs under
    DDP), or None; and the ``sharding_strategy`` that decided it (FSDP1's: which ZeRO stage),
    or None where no such setting did."""
    modules = list(model.modules()) if hasattr(model, "modules") else [model]
    classes = [c for m in modules for c in type(m).__mro__]
    if optimizer is not None:
        classes += type(optimizer).__mro__
    # the wrapper whose sharding_strategy decides (FSDP1's), named as ``Name:VALUE`` in traits
    deciding = {w.partition(":")[0] for n in STRATEGIES.names() for w in traits_of(n).wrappers if ":" in w}
    fsdp1 = next((m for m in modules if any(defines(c, d) for c in type(m).__mro__ for d in deciding)), None)
    how = str(getattr(fsdp1, "sharding_strategy", "FULL_SHARD")).rsplit(".", 1)[-1] if fsdp1 is not None else None
    return _most_sharded(classes, how)


def name_of_wrapper_class(cls: type, sharding_strategy: str | None = None) -> str | None:
    """The registered strategy that ``cls`` (a wrapper class, e.g. torch's DDP) gives away,
    under ``sharding_strategy`` where the wrapper has one (FSDP1's), or None."""
    return _most_sharded(list(cls.__mro__), sharding_strategy)[0]


def _most_sharded(classes: list[type], how: str | None) -> tuple[str | None, str | None]:
    found = {name: wrapped_by(traits_of(name), classes, how) for name in STRATEGIES.names()}
    found = {name: wrapper for name, wrapper in found.items() if wrapper is not None}
    if not found:
        return None, None
    name = max(found, key=sharding_order)
    return name, (how if ":" in found[name] else None)


def build_strategy(cfg, module, optim_spec, precision_cfg, device, zero_grad=None):
    """The strategy ``cfg`` names, built over ``module``, clearing gradients by the rule it
    applies for ``zero_grad`` (``trainer.zero_grad``, a ZeroGrad; None: free)."""
    cls = STRATEGIES.builder(cfg.name)
    strategy = cls.build(cfg, module, optim_spec, precision_cfg, device)
    strategy.grad_zeroing = cls.traits.zero_grad_rule(ZeroGrad.free if zero_grad is None else zero_grad)
    return strategy


for _info in pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "residency", "timing", "traits"):
        importlib.import_module(f"{__name__}.{_info.name}")
