"""Errors every part may raise, in a module that imports nothing of ours.

Builders (strategies, models, tasks) raise :class:`ConfigError` for values they cannot
build; the parent's pre-flight (:mod:`sharded_exp.preflight`) turns it into
``error: ...`` and exit code 2 before any rank starts.
"""

from __future__ import annotations

import importlib.util


class ConfigError(ValueError):
    """A config value that composes but cannot run; the message names value and choices."""


def missing_packages(packages) -> list[str]:
    """The import names in ``packages`` that cannot be imported here (without importing them)."""
    missing = []
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that fails, or a module set to None
            found = False
        if not found:
            missing.append(name)
    return missing
