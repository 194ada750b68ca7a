"""The registries' schemas written as JSON and made again from it, without importing torch.

The strategies', models' and data tasks' schemas live beside their builders, which import
torch (about two seconds). The command line composes its config before it needs torch: a
typo is refused at once, and the rank server imports torch meanwhile. So the schemas are
cached as data: each field's name, type and default (:func:`describe`), and made again as
plain dataclasses of the same names (:func:`rebuild`). Hydra then composes and checks them
exactly as it does the originals: the same keys, the same types, the same enum choices,
the same error messages. Pre-flight makes each group typed with its real schema
(:func:`sharded_exp.launch.preflight.retyped`), whose ``__post_init__`` checks its ranges.

The types a schema may use are those OmegaConf knows: bool, int, float, str, Any, an Enum,
Optional, List, Dict and a nested dataclass. A schema with another type cannot be described,
and the registries are then imported, as without the cache.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import typing
from typing import Any, Optional

from sharded_exp.config import Option

SCALARS = {bool: "bool", int: "int", float: "float", str: "str"}
MISSING = "???"
"""OmegaConf's mark of a value that must be set."""
DECLARED = ("FEEDS", "MODEL_FIELDS", "REQUIRES")
"""A schema's class attributes the command line reads too: what models a data task feeds
(:func:`sharded_exp.config.check_fed`) and the packages a strategy needs
(:func:`sharded_exp.config.check_packages`)."""


def describe(cls: type) -> dict[str, Any]:
    """``cls`` (a schema dataclass) as JSON-ready data; TypeError for a type it cannot hold."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        described = {"name": f.name, "type": _type(hints[f.name]), "default": _value(default)}
        if f.metadata.get("bounds"):  # sharded_exp.config.bounded's: checked on the command line too
            described["bounds"] = dict(f.metadata["bounds"])
        fields.append(described)
    out: dict[str, Any] = {"name": cls.__name__, "fields": fields}
    for attribute in DECLARED:  # a data task's declared needs, a strategy's packages
        if getattr(cls, attribute, None) is not None:
            out[attribute] = _value(getattr(cls, attribute))
    return out


def _type(hint: Any) -> Any:
    if hint in SCALARS:
        return SCALARS[hint]
    if hint is Any:
        return "any"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = [[m.name, m.value] for m in hint]
        return {"enum": hint.__name__, "members": members, "option": issubclass(hint, Option)}
    if dataclasses.is_dataclass(hint):
        return {"dataclass": describe(hint)}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and len(args) == 2 and type(None) in args:
        return {"optional": _type(next(a for a in args if a is not type(None)))}
    if origin is list and len(args) == 1:
        return {"list": _type(args[0])}
    if origin is dict and len(args) == 2 and args[0] is str:
        return {"dict": _type(args[1])}
    raise TypeError(f"a schema type the cache cannot hold: {hint!r}")


def _value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value):
        return {f.name: _value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a schema default the cache cannot hold: {value!r}")


def rebuild_all(descriptions: dict[str, dict[str, Any]]) -> dict[str, type]:
    """Every schema :func:`describe` described, by its name, made again; an enum that several
    fields share (FSDP's ``param_dtype`` and ``reduce_dtype``) is one class, as it was, so one
    field can take another's value (``strategy.reduce_dtype=${strategy.param_dtype}``)."""
    enums: dict[tuple, type] = {}
    return {name: rebuild(description, enums) for name, description in descriptions.items()}


def rebuild(description: dict[str, Any], enums: dict[tuple, type] | None = None) -> type:
    """The dataclass :func:`describe` described: same name, fields, types, defaults and
    declared bounds (:func:`sharded_exp.config.bounded`) and a data task's declared needs
    (:data:`DECLARED`). ``enums``: the enum classes made so far, by name and members (shared between calls)."""
    enums = {} if enums is None else enums
    fields = []
    for f in description["fields"]:
        hint = _hint(f["type"], enums)
        default = _default(hint, f["default"])
        metadata = {"bounds": f["bounds"]} if f.get("bounds") else None
        if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
            spec = dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
        else:
            spec = dataclasses.field(default=default, metadata=metadata)
        fields.append((f["name"], hint, spec))
    declared = {a: _declared(description[a]) for a in DECLARED if a in description}
    return dataclasses.make_dataclass(description["name"], fields, namespace=declared)


def _declared(value: Any) -> Any:
    """A declared class attribute as the schema has it: JSON's lists made tuples again (also
    inside a mapping per ``data.kind``)."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return {k: _declared(v) for k, v in value.items()}
    return value


def _hint(kind: Any, enums: dict[tuple, type]) -> Any:
    if isinstance(kind, str):
        return Any if kind == "any" else {v: k for k, v in SCALARS.items()}[kind]
    if "enum" in kind:
        members = tuple((name, value) for name, value in kind["members"])
        key = (kind["enum"], members, kind.get("option", False))
        if key not in enums:  # an Option reads as its name in a string, as the schemas' own do
            enums[key] = (Option if key[2] else enum.Enum)(kind["enum"], list(members))
        return enums[key]
    if "dataclass" in kind:
        return rebuild(kind["dataclass"], enums)
    if "optional" in kind:
        return Optional[_hint(kind["optional"], enums)]
    if "list" in kind:
        return list[_hint(kind["list"], enums)]
    return dict[str, _hint(kind["dict"], enums)]


def _default(hint: Any, value: Any) -> Any:
    """``value`` as the field's default: an enum member by name, a nested dataclass made."""
    if value == MISSING or value is None:  # OmegaConf's own "???": a value that must be set
        return value
    inner = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return inner[value]
    if dataclasses.is_dataclass(inner):
        return inner(**value)
    return value
