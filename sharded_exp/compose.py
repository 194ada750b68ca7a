"""Composing the config tree: schemas into Hydra's ConfigStore, numeric group choices, and
``compose()`` for code that is not a Hydra app (the planner, tests, benchmarks)."""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import re
import tempfile

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from omegaconf import DictConfig, OmegaConf, open_dict

from sharded_exp import __version__, config
from sharded_exp.errors import ConfigError
from sharded_exp.precision import alias_options
from sharded_exp.registry import PLUGINS_ENV, import_plugins
from sharded_exp.schema_cache import describe, rebuild_all

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")  # shipped inside the package


def register_schemas(query: bool = False) -> None:
    """Store every schema in Hydra's ConfigStore as ``schema_<group>_<kind>``, a config
    outside every group, so that neither the groups' options nor ``--help`` and tab
    completion ever list a schema. A group's YAML files start from theirs:
    ``- /schema_<group>_<kind>@_here_``.

    The fixed groups' schemas live in :mod:`sharded_exp.config`; strategies, models and
    data tasks bring their own next to their builders (one module + one YAML file adds
    one), so they are read from the registries here. ``query``: the command line composes
    (a run, or Hydra's questions: ``--help``, ``--cfg``, ``-sc``), and may do it without
    importing torch; see :func:`registry_schemas`. The command line's are stored once a
    process (its spelling check, then Hydra); a library call stores the registries as they are.
    """
    # conf/config.yaml's sweep subdirectories
    OmegaConf.register_new_resolver("point_dirname", point_dirname, replace=True)
    global _command_line_stored
    plugins = os.environ.get(PLUGINS_ENV)
    if query and _command_line_stored == (plugins,):
        return  # stored already in this process: the command line's spelling check, then Hydra
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=config.Config)
    cs.store(name="plan_schema", node=config.PlanConfig)
    cs.store(name="schema_precision_precision", node=config.PrecisionConfig)
    for alias, option in alias_options().items():  # precision=fp16 is precision=16 (Precision's names)
        cs.store(group="precision", name=alias, node={"defaults": [option, "_self_"]})
    cs.store(name="schema_optimizer_optimizer", node=config.OptimizerConfig)
    cs.store(name="schema_trainer_trainer", node=config.TrainerConfig)
    cs.store(name="schema_logger_logger", node=config.LoggerConfig)
    cs.store(name="schema_paths_paths", node=config.PathsConfig)
    for name, node in registry_schemas(query).items():
        cs.store(name=name, node=node)
    _command_line_stored = (plugins,) if query else None


_command_line_stored: tuple[str | None] | None = None
"""The plugins named when this process last stored the command line's schemas; None when
what is stored last is a library call's (or nothing)."""

REGISTRY_PACKAGES = ("strategies", "models", "data")
"""The packages whose modules register schemas beside their builders (and import torch)."""

REGISTRY_GROUPS = ("strategy", "model", "data")
"""The config groups whose schemas come from those registries."""

CACHE_FORMAT = "3"
"""The cache file's layout: :func:`sharded_exp.schema_cache.describe`'s (part of its name)."""


def schemas_cache_file() -> str | None:
    """Where the registries' schemas are cached for the command line, named by a hash of
    the registry packages' sources and of the code that writes and reads them (any edit
    makes a new name); None with out-of-tree plugins, whose schemas are always imported."""
    if os.environ.get(PLUGINS_ENV):
        return None
    package = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha1((__version__ + CACHE_FORMAT).encode())
    sources = [path for sub in REGISTRY_PACKAGES for path in sorted(glob.glob(os.path.join(package, sub, "*.py")))]
    sources += [os.path.join(package, name) for name in ("config.py", "schema_cache.py")]  # Option; the format
    for path in sources:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + f.read())
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sharded_exp", f"schemas-{digest.hexdigest()[:16]}.json")


def registry_schemas(query: bool = False) -> dict:
    """The strategies', models' and data tasks' schemas by ConfigStore name.

    A library call (the planner, tests) imports the registries (and torch with them) and
    gets their dataclasses; it also writes them, described, to :func:`schemas_cache_file`.
    The command line (``query``: a run, ``--help``, ``--cfg job``, tab completion, which
    Hydra asks at every TAB) reads that file instead when it is there, and gets the same
    dataclasses made again (:mod:`sharded_exp.schema_cache`): the same keys, types and
    defaults, composed without importing torch. Without the file it imports the
    registries like a library call.
    """
    path = schemas_cache_file()
    if query and path:
        made = _read_cache(path)
        if made is not None:
            return made
    try:  # a plugin's model, strategy or task brings its schema: a YAML of its own may name it
        import_plugins()
    except ConfigError:
        pass  # a module that cannot be imported is refused by the job's own check (exit 2), said there
    nodes = {}
    for group, registry in registries():
        for name in registry.names():
            nodes[f"schema_{group}_{name}"] = registry.config_class(name)
    if path and (query or not os.path.exists(path)):  # a command line here found none it could read
        _write_cache(path, nodes)
    return nodes


def registries() -> tuple:
    """``(group, registry)`` for each of :data:`REGISTRY_GROUPS`: the strategies, models and data tasks."""
    # lazy: the registries import torch, which a command line with the cache never needs
    from sharded_exp.data import TASKS
    from sharded_exp.models import MODELS
    from sharded_exp.strategies import STRATEGIES

    return tuple(zip(REGISTRY_GROUPS, (STRATEGIES, MODELS, TASKS), strict=True))


def _read_cache(path: str) -> dict | None:
    """The schemas made again from the cache file; None when it is missing or not one this
    code wrote whole (any edit to the sources names another file, so this is damage)."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != CACHE_FORMAT or not data.get("complete"):
            return None
        return rebuild_all(data["schemas"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: str, nodes: dict) -> None:
    try:  # a cache: a schema it cannot describe, or a home that cannot be written, costs only speed
        described = {name: describe(cls) for name, cls in nodes.items()}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as f:
            json.dump({"format": CACHE_FORMAT, "complete": True, "schemas": described}, f)
        os.replace(f.name, path)
    except (OSError, TypeError):
        pass


MAX_DIRNAME = 200
"""Bytes of a sweep point's directory name at most (filesystems allow 255)."""


def point_dirname(overrides: str) -> str:
    """A sweep point's directory name from its overrides: ``precision=8``, not
    ``precision='8'`` (the quotes :func:`quote_numeric_choices` adds for Hydra's parser),
    and cut to :data:`MAX_DIRNAME` bytes with a short hash of the whole when longer (many
    overrides: ``File name too long`` otherwise)."""
    name = str(overrides).replace("'", "").replace("/", "_")
    if len(name.encode()) <= MAX_DIRNAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return name.encode()[: MAX_DIRNAME - 9].decode(errors="ignore") + "_" + digest


NUMBER_NAMES = {"precision": {option: alias for alias, option in alias_options().items()}}
"""Group options named by a number, and the option that is the same one by a name
(precision ``fp32`` is ``32``, :class:`sharded_exp.precision.Precision`; results name it
``32`` either way)."""
NUMBER = re.compile(r"(?<![\w.])(['\"]?)([0-9][0-9.]*)\1(?![\w.])")
"""A number in an override's value (``32`` in ``choice(32,bf16)``), quoted or not; not one
inside a name (``gpt2``) or a longer number."""


def quote_numeric_choices(args: list[str], conf_dir: str = CONF_DIR) -> list[str]:
    """Let ``precision=16`` (and sweeps like ``precision=32,16``) name a config group option.

    Hydra parses an unquoted ``16`` as an int and refuses it as a group choice ("Config
    group override must be a string"), and quoting it is not enough in a sweep: Optuna
    (``choice(32,bf16)``) formats its pick back into ``precision=32``, and so do Hydra's
    ``sort()`` and ``glob(*)`` (the options 16 and 32). So before Hydra parses the command
    line, a number naming an option with a name (:data:`NUMBER_NAMES`) becomes that name
    (``precision=32,16`` -> ``precision=fp32,fp16``, also in ``choice()``, ``sort()``,
    ``shuffle()`` and ``hydra.sweeper.params.precision=``), ``glob(...)`` over such a group
    becomes the list of the names it matches, and any other number of a group is quoted
    (``precision=8`` -> ``'8'``: Hydra then says no such option). Everything else passes
    through unchanged. Sweeper params in YAML never pass through here:
    :func:`sharded_exp.sweep.check_multirun` refuses a number there, naming the names.
    """
    out = []
    for arg in args:
        m = re.fullmatch(r"([+~]{0,2})((?:hydra\.sweeper\.params\.)?([\w/]+))=(.+)", arg, re.DOTALL)
        if m and "${" not in m.group(4) and os.path.isdir(os.path.join(conf_dir, m.group(3))):
            prefix, key, group, value = m.groups()
            names = {} if "~" in prefix else NUMBER_NAMES.get(group, {})  # ~precision=32 deletes the choice as set
            if value.startswith("glob("):
                value = (names and _glob_names(group, value, names, conf_dir)) or value
            else:
                value = numbers_named(value, names)
            arg = f"{prefix}{key}={value}"
        out.append(arg)
    return out


def numbers_named(value: str, names: dict[str, str]) -> str:
    """``value`` with each number that ``names`` names replaced by its name, any other number quoted."""
    return NUMBER.sub(lambda m: names.get(m.group(2)) or f"'{m.group(2)}'", value)


def _glob_names(group: str, value: str, names: dict[str, str], conf_dir: str) -> str | None:
    """The options ``glob(...)`` matches in ``group``, by their names (16 and fp16 are one
    option: listed once, as fp16), sorted as Hydra sorts them; None when it matches nothing
    or does not parse (Hydra then says so itself)."""
    try:
        found = OverridesParser.create().parse_override(f"{group}={value}").value()
    except Exception:  # noqa: BLE001 -- Hydra's own message, when it parses the argument itself
        return None
    if not isinstance(found, Glob):
        return None
    options = sorted(os.path.splitext(n)[0] for n in os.listdir(os.path.join(conf_dir, group)) if n.endswith(".yaml"))
    named = lambda patterns: [names.get(str(p), str(p)) for p in patterns]  # noqa: E731
    chosen = Glob(include=named(found.include), exclude=named(found.exclude)).filter(
        sorted(dict.fromkeys(names.get(o, o) for o in options))
    )
    return ",".join(chosen) or None


def plain_registry_groups(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` whose registry groups are plain data (interpolations kept): what
    travels pickled to another process, where the schemas the command line made from the
    cache do not exist (pre-flight makes the groups typed again, from the real schemas)."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for group in REGISTRY_GROUPS:
            if group in out and not OmegaConf.is_missing(out, group):
                out[group] = OmegaConf.create(OmegaConf.to_container(out[group], resolve=False, enum_to_str=True))
    return out


def compose(overrides: list[str], config_name: str = "config"):
    """The composed config of ``conf/<config_name>.yaml`` with command-line style overrides."""
    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name, overrides=quote_numeric_choices(overrides))
