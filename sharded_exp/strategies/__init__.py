"""Strategy registry: how a model and its optimizer are wrapped for data-parallel training.

Adding a strategy is one module in this package (a :class:`~.base.Strategy` subclass with
its ``Config`` dataclass, registered with ``@STRATEGIES.register``) plus one YAML file in
``conf/strategy/``; every module here is imported automatically. A strategy that needs a
package we do not depend on names it in ``requires`` and imports it inside ``build``, so
the others run without it (checked before any rank starts).
"""

import importlib
import pkgutil

from sharded_exp.registry import Registry

STRATEGIES = Registry("strategy")


def by_sharding(names) -> list[str]:
    """``names`` from the least sharded strategy to the most (``Strategy.sharding``), by name
    among equals; a name not registered comes last."""

    def key(name):
        try:
            return (STRATEGIES.builder(name).sharding_level(), name)
        except Exception:  # noqa: BLE001 -- not registered (a point of an older sweep)
            return (99, name)

    return sorted(names, key=key)


def sharding_of(name: str) -> int:
    """``Strategy.sharding_level()`` of a registered strategy."""
    return STRATEGIES.builder(name).sharding_level()


def offloads_to_host(strategy_cfg) -> bool:
    """Does the strategy ``strategy_cfg`` configures keep model states in host memory?"""
    return STRATEGIES.builder(strategy_cfg.name).offloads_to_host(strategy_cfg)


def build_strategy(cfg, module, optim_spec, precision_cfg, device, zero_grad=None):
    """The strategy ``cfg`` names, built over ``module``, clearing gradients by the rule it
    applies for ``zero_grad`` (``trainer.zero_grad``, a ZeroGrad; None: free)."""
    from sharded_exp.config import ZeroGrad

    cls = STRATEGIES.builder(cfg.name)
    strategy = cls.build(cfg, module, optim_spec, precision_cfg, device)
    strategy.grad_zeroing = cls.zero_grad_rule(ZeroGrad.free if zero_grad is None else zero_grad)
    return strategy


for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")
