"""One plain registry per kind of part: a name maps to a builder and its config schema."""

from __future__ import annotations

from collections.abc import Callable


class Registry:
    """Name -> (builder, config dataclass). Registering a name twice is an error."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[Callable, type]] = {}

    def register(self, name: str, config: type) -> Callable[[Callable], Callable]:
        def decorator(builder: Callable) -> Callable:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = (builder, config)
            return builder

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def _entry(self, name: str) -> tuple[Callable, type]:
        if name not in self._entries:
            from sharded_exp.config import ConfigError

            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def builder(self, name: str) -> Callable:
        return self._entry(name)[0]

    def config_class(self, name: str) -> type:
        return self._entry(name)[1]
