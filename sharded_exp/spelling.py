"""A mistyped override refused before torch is imported, with the closest valid name.

Hydra refuses an unknown key (``trainer.wold_size=4``), group (``strateg=fsdp``) or option
(``strategy=fdsp``) only once it composes, and a run imports torch and every registry before
that (the typed schemas). Its message offers ``+key`` (adding a key is never what a typo
wants), the config search path and the ``HYDRA_FULL_ERROR`` line, but not the name meant.

:func:`refuse_misspelled` composes the command line's overrides first, as Hydra's questions
are answered (from the schema cache, no torch), and answers what it cannot compose in one
line with difflib's closest match; a value a group's schema refuses (``trainer.world_size=0``)
is said the same way, since those range checks need no torch either, as is a
``model.config_file`` that is no readable config.json. Anything it does not recognise is
left to Hydra, which says it as before.
"""

from __future__ import annotations

import itertools
import re
import sys

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from sharded_exp.compose import CONF_DIR, quote_numeric_choices, register_schemas
from sharded_exp.config import check_ranges
from sharded_exp.config_file import check_attn_name, check_head_counts, is_target_model, read_config_file
from sharded_exp.errors import ConfigError, closest
from sharded_exp.launch.layout import external_layout

UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'")
UNKNOWN_OPTION = re.compile(r"Could not find '([^']+)/([^'/]+)'")
OWN_CONFIG = ("-cp", "-cn", "-cd", "--config-path", "--config-name", "--config-dir")
"""Flags that compose another config than ours: left to Hydra."""


def keys_of(cfg, prefix: str = "") -> list[str]:
    """Every key of ``cfg`` as a dotted path (``trainer.world_size``), groups included."""
    out = []
    for key in cfg:
        path = f"{prefix}{key}"
        out.append(path)
        node = cfg._get_node(key)
        if OmegaConf.is_dict(node):
            out += keys_of(node, f"{path}.")
    return out


def parse(overrides: list[str]) -> list | None:
    """Hydra's reading of the overrides, or None when they do not parse (Hydra then says why)."""
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return None


def first_values(parsed: list) -> list[str] | None:
    """The overrides with a sweep (``a=1,2``, ``choice(...)``) replaced by its first value,
    and Hydra's own (``hydra.*``, ``hydra/...``) left out."""
    out = []
    for override in parsed:
        key = override.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()), None)  # a range's first, not its every value
            if first is None:
                return None
            out.append(f"{key}={first}")
        else:
            out.append(override.input_line)
    return out


def _compose(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name, overrides=overrides)


def _unknown_key(key: str, config_name: str, overrides: list[str]) -> str:
    others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        keys = keys_of(_compose(config_name, others))
    except Exception:  # noqa: BLE001 -- the suggestion is a courtesy: the refusal stands without it
        keys = []
    meant = closest(key, keys)
    hint = f"; did you mean {meant}?" if meant else ""
    # only a model of your own (model._target_) or a custom dataset's factory reads a key added with +
    added = f"; +{key}=... adds a new one, for a model of your own" if key.startswith("model.") else ""
    added = f"; +{key}=... adds a new one" if key.startswith("data.kwargs.") else added
    return f"{key} is not a setting of this config{hint} (--cfg job prints every setting{added})"


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` (files and stored nodes), [] for no group."""
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return GlobalHydra.instance().config_loader().get_group_options(group)
    except Exception:  # noqa: BLE001 -- a courtesy, as above
        return []


def _unknown_option(group: str, option: str, options: list[str] | None = None) -> str:
    options = group_options(group) if options is None else options
    meant = closest(option, options)
    hint = f"; did you mean {group}={meant}?" if meant else ""
    listed = f" (options: {', '.join(options)})" if options else ""
    return f"{group}={option} is not an option of {group}{hint}{listed}"


def misspelled(argv: list[str], config_name: str = "config") -> str | None:
    """What is wrong with the command line's overrides, in one line, or None when they
    compose (or when this check cannot tell: Hydra decides then). Never raises: a check that
    cannot read a command line (a sweeper's ``interval(...)``, a plugin's syntax) leaves it
    to Hydra, which says what it says today."""
    try:
        return _misspelled(argv, config_name)
    except Exception:  # noqa: BLE001 -- the check is a courtesy in front of Hydra's own, never a new failure
        return None


def _misspelled(argv: list[str], config_name: str) -> str | None:
    if any(a.split("=", 1)[0] in OWN_CONFIG for a in argv):
        return None
    parsed = parse(quote_numeric_choices([a for a in argv if not a.startswith("-")]))
    overrides = first_values(parsed) if parsed else None
    if not overrides:
        return None
    register_schemas(query=True)
    for override in parsed:  # every value of a swept group, not only the first that is composed
        if override.is_sweep_override() and not override.get_key_element().startswith("hydra"):
            group = override.get_key_element().lstrip("+~")
            options = group_options(group)
            if not options:  # a value's sweep, not a group's: its values are checked below
                continue
            wrong = [v for v in override.sweep_string_iterator() if v not in options and v != "null"]
            if wrong:
                return _unknown_option(group, wrong[0], options)
    try:
        cfg = _compose(config_name, overrides)
    except MissingConfigException as exc:
        found = UNKNOWN_OPTION.search(str(exc))
        return _unknown_option(found.group(1), found.group(2)) if found else None
    except ConfigCompositionException as exc:
        found = UNKNOWN_KEY.search(str(exc))
        return _unknown_key(found.group(1), config_name, overrides) if found else None
    except Exception:  # noqa: BLE001 -- anything else (a plugin's launcher, an interpolation) is Hydra's to say
        return None
    sized = certain_world_size(config_name, [o.get_key_element() for o in parsed])
    problem = value_problem(cfg, job_world_size(cfg) if sized else None)
    if problem is not None:
        return problem
    for others in other_points(parsed, overrides):  # a sweep's other values, each composed and checked
        try:
            point = _compose(config_name, others)
            problem = value_problem(point, job_world_size(point) if sized else None)
        except Exception:  # noqa: BLE001 -- a point that does not compose here is its job's to say
            continue
        if problem is not None:
            return problem
    return problem


def value_problem(cfg, world_size: int | None = None) -> str | None:
    """A value the config alone shows wrong (a range, a declared bound, a model's size, a
    Hugging Face model's head counts or kernel name, a config.json path), said as pre-flight
    says it; None when there is none, or when a group is not ready to be checked here.
    ``world_size``: the job's, where this command knows it for certain (:func:`certain_world_size`),
    for the values that must divide it."""
    try:
        check_ranges(cfg, world_size)
        model = OmegaConf.select(cfg, "model", default=None)
        path = OmegaConf.select(cfg, "model.config_file", default=None)
        if path:  # a Hugging Face config.json: a wrong path or a file that is no config, said at once
            read_config_file(str(path))
        if isinstance(model, DictConfig) and is_target_model(model):
            check_attn_name(model)
            if not path:  # the file's config replaces model.config: its heads are pre-flight's to check
                check_head_counts(model)
    except ConfigError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 -- a group that is not ready to be typed here is checked later
        return None
    return None


UNSIZED = ("hydra/launcher", "hydra.launcher", "hydra.sweeper", "experiment", "hparams_search")
"""Overrides after which the command line cannot know the job's world size from the config it
composes: another launcher (submitit's tasks are the ranks), a sweeper's own parameters, and
the presets that sweep ``trainer.world_size`` through them (``experiment=seed_study_gpu``)."""


def certain_world_size(config_name: str, keys: list[str]) -> bool:
    """Whether the job's world size is the composed config's (or torchrun's or SLURM's), so
    that a value that must divide it can be held here: a training command, none of
    :data:`UNSIZED` among the override ``keys`` (a plan sizes its own points: ``plan.world_sizes``)."""
    return config_name == "config" and not any(k.lstrip("+~").startswith(UNSIZED) for k in keys)


def job_world_size(cfg) -> int | None:
    """The job's world size as this command will run it: torchrun's or SLURM's where they
    start the ranks, else ``trainer.world_size`` (None where it is not a count yet: an
    interpolation that does not resolve here, a value below 1)."""
    layout = external_layout()
    if layout is not None:
        return layout.world_size
    value = OmegaConf.select(cfg, "trainer.world_size", default=None, throw_on_resolution_failure=False)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


MAX_SWEEP_POINTS = 8
"""A sweep's points composed and checked on the command line beyond the first, at most:
each is a composition (about 0.25 s here), Hydra's own, so that a value is read exactly as
the job will read it (a later override of the same key, quoting, a ``@package _global_``
preset); a longer sweep's other values are checked by their own jobs."""


def other_points(parsed: list, first: list[str]):
    """The command line once for each value of each sweep after its first, the other sweeps
    at their first value (one value varied at a time: combinations are their jobs' to
    check), at most :data:`MAX_SWEEP_POINTS`. A ``shuffle(...)`` sweep, whose order Hydra
    draws anew, is left to its jobs."""
    ours = [o for o in parsed if not o.get_key_element().lstrip("+~").startswith("hydra")]
    count = 0
    for position, override in enumerate(ours):
        if not override.is_sweep_override() or getattr(override.value(), "shuffle", False):
            continue
        for value in itertools.islice(override.sweep_string_iterator(), 1, MAX_SWEEP_POINTS + 1):
            count += 1
            if count > MAX_SWEEP_POINTS:
                return
            yield [*first[:position], f"{override.get_key_element()}={value}", *first[position + 1 :]]


def refuse_misspelled(argv: list[str], config_name: str = "config") -> None:
    """Exit 2 with one ``error:`` line when :func:`misspelled` finds something."""
    problem = misspelled(argv, config_name)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
