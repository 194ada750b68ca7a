"""What Hydra's sweepers and launchers get from a job: the objective ``main`` returns, and
which launchers may run the points.

    python -m sharded_exp -m hydra/sweeper=optuna objective=throughput/samples_per_s \\
        hydra.sweeper.direction=maximize hydra.sweeper.n_trials=8 \\
        'hydra.sweeper.params={strategy: choice(ddp,zero1,fsdp), trainer.batch_size: choice(16,32,64)}'

``objective`` names a number of ``result.json`` by its path (``throughput/samples_per_s``);
a leading ``-`` negates it (``-memory/peak_allocated_mib_max``: less memory is a larger
value). A point that did not produce it (out of memory, failed, diverged) returns the worst
value for the sweeper's direction (``-inf`` when maximizing, ``+inf`` when minimizing;
Optuna records it as a complete trial), so one bad point never ends the study.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import MutableSequence
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.compose import NUMBER, NUMBER_NAMES, numbers_named
from sharded_exp.errors import ConfigError
from sharded_exp.spelling import UNKNOWN_KEY
from sharded_exp.vocabulary.wandb_names import OBJECTIVES

HOSTS = {
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher": "basic",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": "submitit_local",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher": "submitit_slurm",
}
"""Launchers whose points run in a process that may start the ranks (its own children)."""


def check_objective(objective: str | None) -> None:
    """Refuse an ``objective`` that names no result.json number, listing those allowed."""
    if objective is None:
        return
    path = str(objective).removeprefix("-")
    if path not in OBJECTIVES:
        raise ConfigError(
            f"objective={objective} is not a result.json number main can return; allowed: "
            f"{', '.join(OBJECTIVES)} (a leading - negates it, e.g. -memory/peak_allocated_mib_max), or null"
        )


def objective_value(result: dict[str, Any], objective: str | None, direction: str | None) -> float | None:
    """The number ``main`` returns for ``result`` (None without an objective).

    A point without a finite value (status other than ok, or the figure null) gets the
    worst value for ``direction`` ("maximize": -inf; "minimize" or unknown: +inf)."""
    if objective is None:
        return None
    negate = str(objective).startswith("-")
    value = result_at(result, str(objective).removeprefix("-")) if result.get("status") == "ok" else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return -float(value) if negate else float(value)
    return -math.inf if direction == "maximize" else math.inf


def result_at(result: dict[str, Any], path: str) -> Any:
    """The value at ``path`` in ``result``, or None; a key may hold a slash itself (the
    eval section's ``eval/loss``): the longest key that matches is taken; a number indexes
    a list (``memory/per_rank/0/peak_allocated_mib``)."""
    parts, value = path.split("/"), result
    while parts:
        if isinstance(value, list) and parts[0].isdigit():
            index, parts = int(parts[0]), parts[1:]
            value = value[index] if index < len(value) else None
            continue
        if not isinstance(value, dict):
            return None
        n = next((n for n in range(len(parts), 0, -1) if "/".join(parts[:n]) in value), 0)
        if not n:
            return None
        value, parts = value["/".join(parts[:n])], parts[n:]
    return value


def sweeper_direction(hydra_cfg) -> str | None:
    """The sweeper's direction (Optuna's ``direction``), if it has one: maximize or minimize
    (a list of one direction is that direction; a longer one is refused by :func:`check_multirun`)."""
    direction = hydra_cfg.sweeper.get("direction") if "sweeper" in hydra_cfg else None
    if isinstance(direction, MutableSequence):
        direction = direction[0] if len(direction) == 1 else None
    name = getattr(direction, "name", direction)
    return str(name).lower() if name is not None else None


def hold_sweep_dir(sweep_dir) -> Any:
    """Hold ``hydra.sweep.dir`` for this sweep, as a run directory is held (an exclusive lock
    on ``<sweep dir>/.lock``, which names our pid; released when this process ends, however
    it ends): two live sweeps in one directory would overwrite each other's ``.sweep_id`` and
    each report the other's points. Another live sweep (or job) there: says so and exits 2,
    before this sweep's first point; a lock file left by a process that has ended is no lock."""
    from sharded_exp.checkpoint.storage import hold_directory  # lazy: torch, not for Hydra's questions

    try:
        return hold_directory(
            str(sweep_dir),
            lambda owner: ConfigError(
                f"hydra.sweep.dir={sweep_dir} is in use by a running sweep (pid {owner}); wait for it to end "
                "or choose another hydra.sweep.dir"
            ),
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def release_sweep_dir(lock) -> None:
    """Let the sweep directory go: the lock file is removed, then the lock released."""
    if lock is None or lock.closed:
        return
    with contextlib.suppress(OSError):
        os.remove(lock.name)
    lock.close()


def check_sweeper(sweeper, objective: str | None) -> None:
    """The sweeper's own settings that would fail every point, refused (ConfigError).

    - A list of directions (Optuna's multi-objective study) wants a list of numbers back;
      ``main`` returns one, ``objective``'s.
    - A number naming a group option in the sweeper's params (YAML, or
      ``hydra.sweeper.params={precision: choice(32,16)}``, which are no command-line
      overrides of their own): the sweeper hands it back to Hydra as a number, which no group
      option is (:func:`sharded_exp.compose.quote_numeric_choices` maps those on the command line).
    """
    direction = sweeper.get("direction")
    if isinstance(direction, MutableSequence) and len(direction) > 1:
        listed = ",".join(str(getattr(d, "name", d)) for d in direction)
        raise ConfigError(
            f"hydra.sweeper.direction=[{listed}] asks for {len(direction)} objectives, and main returns one number "
            f"(objective={objective}): set hydra.sweeper.direction=maximize or hydra.sweeper.direction=minimize"
        )
    for key, value in (sweeper.get("params") or {}).items():
        names = NUMBER_NAMES.get(str(key), {})
        found = [n for _, n in NUMBER.findall(str(value)) if n in names]
        if found:
            raise ConfigError(
                f"hydra.sweeper.params.{key}={value}: the sweeper hands {', '.join(found)} back to Hydra as "
                f"numbers, which name no {key} option; use the names: hydra.sweeper.params.{key}="
                f"{numbers_named(str(value), names)} ({', '.join(f'{names[n]} is {n}' for n in found)})"
            )


def sweep_points(config) -> list[list[str]] | None:
    """Every point's overrides of a basic sweeper's multirun, expanded as its sweeper does
    (``BasicSweeper.sweep``: the sweeper's ``params``, a preset's among them, then the command
    line's, parsed with Hydra's config loader, which ``glob(...)`` reads); None for a sweeper
    that draws its points as it goes (Optuna's), outside a Hydra run, or where Hydra cannot
    expand them (its own sweep then says why)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # lazy: only under -m
    from hydra.core.global_hydra import GlobalHydra  # lazy: as above
    from hydra.core.override_parser.overrides_parser import OverridesParser  # lazy: as above
    from hydra.errors import HydraException  # lazy: as above

    task = OmegaConf.select(config, "hydra.overrides.task", default=None)
    if task is None or "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
        return None
    if not GlobalHydra.instance().is_initialized():
        return None
    params = config.hydra.sweeper.get("params") or {}
    overrides = [f"{key}={value}" for key, value in params.items()] + list(task)
    try:
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(overrides)
        return [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]
    except HydraException:
        return None


def check_points_compose(config) -> None:
    """Each point of a basic sweeper's multirun composed (as Hydra validates its batch), before
    the sweep directory is touched: Hydra's own check comes after it has written the sweep's
    ``multirun.yaml`` (and the callback its ``.sweep_id``), so a sweep refused there would leave
    an earlier sweep's directory with another sweep's record (ConfigError naming the point).
    Hydra composes each point again for its own check: a sweep's start takes that much longer."""
    from hydra.core.global_hydra import GlobalHydra  # lazy: only under -m

    points = sweep_points(config)
    if not points:
        return
    loader = GlobalHydra.instance().config_loader()
    for point in points:
        try:
            loader.load_sweep_config(master_config=config, sweep_overrides=point)
        except Exception as exc:  # noqa: BLE001 -- whatever Hydra would refuse, said with the point
            found = UNKNOWN_KEY.search(str(exc))
            group = found.group(1).split(".", 1)[0] if found else None
            choice = next((o for o in point if group and o.lstrip("+~").split("=", 1)[0] == group), None)
            why = (
                f"{found.group(1)} is not a setting of {choice or group or 'this config'}"
                if found
                else (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            )
            raise ConfigError(
                f"the sweep's point {' '.join(point)} does not compose: {why}; nothing was run or written "
                "(sweep the options that have it in a sweep of their own)"
            ) from None


def check_multirun(config, reused: bool = False) -> None:
    """Before the first point of a multirun: a launcher that can host the ranks, a valid
    objective (required by a sweeper that optimizes), sweeper settings every point can run
    with (:func:`check_sweeper`), and, in a sweep directory an earlier sweep left (``reused``),
    every point composing (:func:`check_points_compose`: in a new one a refusal by Hydra
    overwrites nothing, and the points are composed once, by Hydra). Says why and exits 2."""
    target = config.hydra.launcher.get("_target_")
    choice = config.hydra.runtime.choices.get("hydra/launcher", target)
    try:
        if target not in HOSTS:
            raise ConfigError(
                f"hydra/launcher={choice} ({target}) cannot run this job's points: each point starts its own rank "
                "processes, which a pool worker does not host (under joblib's loky workers: \"cannot find context "
                "for 'loky'\"); use "
                f"{', '.join(f'hydra/launcher={n}' for n in HOSTS.values() if n != 'basic')} or the basic launcher "
                "(the default: no hydra/launcher override)"
            )
        check_objective(config.get("objective"))
        check_sweeper(config.hydra.sweeper, config.get("objective"))
        if reused:  # an earlier sweep's record there, which a refusal by Hydra would overwrite
            check_points_compose(config)
        if config.get("report") is not None:  # the report's settings: its own checks, before the first point
            OmegaConf.to_object(config.report)
        optimizing = "optuna" in str(config.hydra.sweeper.get("_target_", ""))
        if optimizing and config.get("objective") is None:
            raise ConfigError(
                f"hydra/sweeper={config.hydra.runtime.choices.get('hydra/sweeper')} optimizes the value main returns: "
                f"set objective= to one of {', '.join(OBJECTIVES)} (a leading - negates it)"
            )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
