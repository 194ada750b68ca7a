"""Strategy registry: how a model and its optimizer are wrapped for data-parallel training.

Adding a strategy is one module in this package (a config dataclass and a builder
registered with ``@STRATEGIES.register``) plus one YAML file in ``conf/strategy/``; every
module here is imported automatically. A builder receives its own config, the bare model
on its device, the optimizer spec and the precision config, and returns a
:class:`~sharded_exp.strategies.base.Strategy`.
"""

import importlib
import pkgutil

from sharded_exp.registry import Registry

STRATEGIES = Registry("strategy")


def build_strategy(cfg, module, optim_spec, precision_cfg, device):
    return STRATEGIES.builder(cfg.name)(cfg, module, optim_spec, precision_cfg, device)


for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")
