"""One plain registry per kind of part: a name maps to a builder and its config schema."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from sharded_exp.errors import ConfigError

PLUGINS_ENV = "SHARDED_EXP_PLUGINS"


def import_plugins() -> None:
    """Import the modules named in SHARDED_EXP_PLUGINS (comma-separated).

    Out-of-tree strategies, models or data tasks register themselves on import; every
    rank and the validating parent must import them.
    """
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"{PLUGINS_ENV} names the module {name!r}, which cannot be imported ({exc}); "
                "check the name and that its directory is on PYTHONPATH"
            ) from None


class Registry:
    """Name -> (builder, config dataclass). Registering a name twice is an error.

    The builder is whatever the kind calls: a function for models and tasks, a
    :class:`~sharded_exp.strategies.base.Strategy` class for strategies. ``config``
    defaults to the builder's own ``Config`` attribute.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[Callable, type]] = {}

    def register(self, name: str, config: type | None = None) -> Callable[[Callable], Callable]:
        def decorator(builder: Callable) -> Callable:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = (builder, config if config is not None else builder.Config)
            return builder

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def _entry(self, name: str) -> tuple[Callable, type]:
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def builder(self, name: str) -> Callable:
        return self._entry(name)[0]

    def config_class(self, name: str) -> type:
        return self._entry(name)[1]
