"""Composing the config tree: schemas into Hydra's ConfigStore, numeric group choices, and
``compose()`` for code that is not a Hydra app (the planner, tests, benchmarks)."""

from __future__ import annotations

import os
import re

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sharded_exp import config

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")  # shipped inside the package


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore as ``schema/<group>/<kind>``, outside the
    groups themselves, so that Hydra never lists a schema as an option of its group. A
    group's YAML files start from theirs: ``- /schema/<group>/<kind>@_here_``.

    The fixed groups' schemas live in :mod:`sharded_exp.config`; strategies, models and
    data tasks bring their own next to their builders (one module + one YAML file adds
    one), so they are read from the registries here.
    """
    from sharded_exp.data import TASKS
    from sharded_exp.models import MODELS
    from sharded_exp.strategies import STRATEGIES

    # conf/config.yaml's sweep subdirectories
    OmegaConf.register_new_resolver("point_dirname", point_dirname, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=config.Config)
    cs.store(name="plan_schema", node=config.PlanConfig)
    cs.store(group="schema/precision", name="precision", node=config.PrecisionConfig)
    cs.store(group="schema/optimizer", name="optimizer", node=config.OptimizerConfig)
    cs.store(group="schema/trainer", name="trainer", node=config.TrainerConfig)
    cs.store(group="schema/logger", name="logger", node=config.LoggerConfig)
    for group, registry in (("strategy", STRATEGIES), ("model", MODELS), ("data", TASKS)):
        for name in registry.names():
            cs.store(group=f"schema/{group}", name=name, node=registry.config_class(name))


MAX_DIRNAME = 200
"""Bytes of a sweep point's directory name at most (filesystems allow 255)."""


def point_dirname(overrides: str) -> str:
    """A sweep point's directory name from its overrides: ``precision=32``, not
    ``precision='32'`` (the quotes :func:`quote_numeric_choices` adds for Hydra's parser),
    and cut to :data:`MAX_DIRNAME` bytes with a short hash of the whole when longer (many
    overrides: ``File name too long`` otherwise)."""
    import hashlib

    name = str(overrides).replace("'", "").replace("/", "_")
    if len(name.encode()) <= MAX_DIRNAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return name.encode()[: MAX_DIRNAME - 9].decode(errors="ignore") + "_" + digest


def quote_numeric_choices(args: list[str], conf_dir: str = CONF_DIR) -> list[str]:
    """Let ``precision=16`` (and sweeps like ``precision=32,16``) name a config group option.

    Hydra parses an unquoted ``16`` as an int and refuses it as a group choice, so a user
    would have to type ``precision="'16'"``. Numeric choices of config groups are quoted
    here before Hydra parses the command line, also in a sweep's ``choice(32,16)``;
    everything else passes through unchanged. (Sweeper params in YAML never pass through
    here: there the options' string names serve, ``precision: fp32,fp16``.)
    """
    out = []
    for arg in args:
        m = re.fullmatch(r"([+~]{0,2}[\w/]+)=(choice\(([\w., ]+)\)|[\w.,]+)", arg)
        if m and os.path.isdir(os.path.join(conf_dir, m.group(1).lstrip("+~"))):
            items = [v.strip() for v in (m.group(3) or m.group(2)).split(",")]
            quoted = ",".join(f"'{v}'" if re.fullmatch(r"[0-9.]+", v) else v for v in items)
            arg = m.group(1) + "=" + (f"choice({quoted})" if m.group(3) else quoted)
        out.append(arg)
    return out


def compose(overrides: list[str], config_name: str = "config"):
    """The composed config of ``conf/<config_name>.yaml`` with command-line style overrides."""
    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name, overrides=quote_numeric_choices(overrides))
