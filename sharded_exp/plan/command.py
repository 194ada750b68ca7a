"""``sharded-exp-plan`` (``python -m sharded_exp.plan``): the command.

Hydra's questions (``--help``, ``--cfg job``, ``--info``, ``-sc install=bash`` and tab
completion) are answered by a Hydra app over ``conf/plan.yaml`` from the schema cache, as
``sharded-exp`` answers them: torch is never imported. A plan composes the config, checks it
(:func:`check_plan`, before any fake step), plans the points (:mod:`sharded_exp.plan.points`)
with a progress bar on stderr, and prints the table (:mod:`sharded_exp.plan.table`).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import hydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from sharded_exp.compose import compose, quote_numeric_choices, register_schemas
from sharded_exp.config import PlanConfig
from sharded_exp.config_file import is_target_model
from sharded_exp.errors import ConfigError
from sharded_exp.output import charts
from sharded_exp.plan import table
from sharded_exp.plan.progress import Progress
from sharded_exp.precision import Precision
from sharded_exp.predict.allocator import alloc_conf_from_env, parse_alloc_conf
from sharded_exp.questions import is_query
from sharded_exp.spelling import misspelled

WORLD_SIZES = "must be a non-empty list of integers >= 1"
"""What plan.world_sizes must be: said of one below 1 (:func:`check_plan`) and of one that is
no integer (Hydra's refusal, :func:`composition_error`)."""


def composition_error(exc: Exception, argv: list[str]) -> str:
    """Hydra's refusal of an override, with the reason it keeps in its cause ("Error merging
    override plan.units=x" alone says what, not why); a world size that is no integer
    (``plan.world_sizes=[2.5]``) is said as :func:`check_plan` says a world size below 1."""
    cause = exc.__cause__
    key = str(getattr(cause, "full_key", None) or "")
    if key == "plan.world_sizes" or key.startswith("plan.world_sizes["):
        typed = [a.partition("=")[2] for a in argv if a.lstrip("+").partition("=")[0] == "plan.world_sizes"]
        return f"plan.world_sizes={typed[-1] if typed else '?'} {WORLD_SIZES}"
    reason = str(cause).splitlines()[0] if cause is not None and str(cause) else ""
    return f"{exc}: {reason}" if reason and reason not in str(exc) else str(exc)


MAX_FAKED_RANKS = 16384
"""The largest world size a model is faked at (65,536 ranks took 19 s for the CPU-sized GPT under
fsdp and sharded_ddp, 10,000 took 113 s for a larger model; a million never finished)."""


def check_alloc_conf(conf: str | None, device: str = "cuda") -> None:
    """The allocator settings a CUDA plan models, read as torch reads ``PYTORCH_CUDA_ALLOC_CONF``
    (ConfigError naming the bad option or value, and every known one), before anything is faked:
    ``plan.alloc_conf``, or where that is null the variable from this environment it falls back
    to (:func:`~sharded_exp.predict.allocator.alloc_conf_from_env`; a CPU plan reads neither)."""
    where = "plan.alloc_conf"
    if conf is None and device == "cuda":
        conf = alloc_conf_from_env()
        where = (
            "PYTORCH_CUDA_ALLOC_CONF" if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is not None else "PYTORCH_ALLOC_CONF"
        )
    if conf:
        try:
            parse_alloc_conf(conf)
        except ValueError as exc:
            hint = (
                " (from this environment: fix or unset it, or set plan.alloc_conf)"
                if where != "plan.alloc_conf"
                else ""
            )
            why = str(exc).removeprefix(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: ")
            raise ConfigError(f"{where}={conf!r}{hint}: {why}") from None


def check_plan(cfg: PlanConfig, argv: list[str] = ()) -> None:
    """The planner's inputs, by the training entry point's rules (ConfigError names them).
    ``argv``: the command line, to tell a model the user chose from the default one."""
    # lazy: these import torch, which Hydra's questions (answered by this module) never need
    from sharded_exp.launch.preflight import check_values
    from sharded_exp.plan.points import MAX_UNITS, _value
    from sharded_exp.strategies import STRATEGIES

    check_values(cfg)  # names and packages; made typed, every group's own ranges (plan.params and others)
    p = cfg.plan
    chosen = [a for a in argv if a.lstrip("+").startswith(("model=", "model."))]
    if p.params is not None and chosen:
        raise ConfigError(
            f"plan.params={p.params:g} plans a raw parameter count, and {' '.join(chosen)} would be ignored: give "
            "plan.params (with plan.units) or a model, not both"
        )
    if not p.world_sizes or any(ws < 1 for ws in p.world_sizes):
        raise ConfigError(f"plan.world_sizes={list(p.world_sizes)} {WORLD_SIZES}")
    if p.params is None and max(p.world_sizes) > MAX_FAKED_RANKS:
        raise ConfigError(
            f"plan.world_sizes={list(p.world_sizes)}: a model is planned by faking its step at each world size, "
            f"up to {MAX_FAKED_RANKS:,} ranks (a fake step's sharded tensors grow with the ranks: minutes beyond); "
            "plan more ranks as a raw parameter count (plan.params=..., plan.units=...), which extrapolates exactly"
        )
    if not 1 <= p.units <= MAX_UNITS:
        raise ConfigError(
            f"plan.units={p.units} must be between 1 and {MAX_UNITS:,} (the model's repeated blocks, "
            "a transformer's layers: each is a tensor per rank in the raw model)"
        )
    for name in p.strategies or []:
        STRATEGIES.builder(name)  # raises, naming the registered ones
    check_alloc_conf(p.get("alloc_conf", None), _value(p.device) or "cuda")
    _check_this_gpu(p)
    _check_levers(p)
    _check_plot(p)
    if _value(p.find) == "fastest" and p.params is not None:
        raise ConfigError(
            f"plan.find=fastest needs a model: a raw parameter count (plan.params={p.params:g}) has no step to "
            "time; plan a model (model=gpt_7b, ...)"
        )
    if _value(p.find) == "batch_size" and p.params is not None:
        raise ConfigError(
            f"plan.find=batch_size needs a model: a raw parameter count (plan.params={p.params:g}) has no "
            "activations, so no batch would ever stop fitting; plan a model (model=gpt_7b, ...) to find its batch"
        )
    builder = STRATEGIES.builder(cfg.strategy.name)
    for ws in p.world_sizes:  # a layout training would refuse (strategy.replicate=2 at 3 ranks) is no plan
        try:
            builder.check(cfg.strategy, int(ws), _value(p.device) or "cuda")
        except ConfigError as exc:
            raise ConfigError(f"plan.world_sizes={list(p.world_sizes)}: at {ws} ranks, {exc}") from None
    if _value(p.find) == "depth" and (p.params is not None or "n_layers" not in cfg.model):
        what = "a raw parameter count (plan.params)" if p.params is not None else f"model={cfg.model.name}"
        raise ConfigError(f"plan.find=depth needs a model with model.n_layers (e.g. model=gpt); {what} has none")


def _check_this_gpu(p) -> None:
    """``plan.device_profile=this`` for a CUDA plan measures this machine's GPU: one must be there."""
    import torch  # lazy: Hydra's questions (answered by this module) never need it

    from sharded_exp.plan.points import _value  # lazy: imports torch

    if (
        p.get("device_profile", None) == "this"
        and (_value(p.device) or "cuda") == "cuda"
        and not torch.cuda.is_available()
    ):
        raise ConfigError(
            "plan.device_profile=this with plan.device=cuda prices the step on this machine's GPU, and it has none: "
            "name a GPU profile (plan.device_profile=h100_sxm, ...) or plan this CPU (plan.device=cpu)"
        )


def _check_levers(p) -> None:
    """plan.levers: known levers, each once; no list named twice; offload only with an FSDP
    strategy and a GPU."""
    # lazy: these import torch, which Hydra's questions (answered by this module) never need
    from sharded_exp.plan.points import LEVERS, _value, lever_names
    from sharded_exp.strategies import STRATEGIES

    for combo in p.get("levers", None) or []:
        bad = [x for x in lever_names(str(combo)) if x not in LEVERS]
        if bad or not str(combo):
            raise ConfigError(
                f"plan.levers entry {combo!r}: {', '.join(bad) or 'empty'} is not a lever; levers: none, or "
                f"{', '.join(LEVERS)} joined with + (e.g. ac+offload)"
            )
        names = lever_names(str(combo))
        if len(set(names)) < len(names) or len({"ac", "ac_selective", "ac_selective_op"} & set(names)) > 1:
            raise ConfigError(
                f"plan.levers entry {combo!r} sets one lever twice (ac, ac_selective and ac_selective_op are "
                "settings of activation checkpointing): name each once, e.g. ac+offload"
            )
    for key in ("world_sizes", "strategies", "levers"):
        values = [str(v) for v in (p.get(key, None) or [])]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(f"plan.{key} names {', '.join(twice)} twice: each is planned once; name it once")
    combos = [str(c) for c in (p.get("levers", None) or [])]
    if any("offload" in lever_names(c) for c in combos):
        takers = [n for n in (p.strategies or STRATEGIES.names()) if STRATEGIES.builder(n).traits.shards_parameters]
        if not takers:
            raise ConfigError(
                f"plan.levers={combos}: offload moves FSDP's sharded states to the host, and plan.strategies="
                f"{list(p.strategies)} has no FSDP strategy; add fsdp or fsdp_grad_op, or drop offload"
            )
        if _value(p.device) == "cpu":
            raise ConfigError(
                "plan.levers with offload and plan.device=cpu: offload moves states from a GPU to host memory, where a "
                "CPU run holds them already (a CPU run refuses it); plan it for plan.device=cuda"
            )


def _check_plot(p) -> None:
    """plan.plot names an image file in a directory that can be written (said now, not after
    minutes of planning)."""
    if p.plot and (not str(p.plot).lower().endswith((".png", ".svg", ".pdf")) or os.path.isdir(p.plot)):
        raise ConfigError(f"plan.plot={p.plot} must name a .png, .svg or .pdf file to draw the plan into")
    if p.plot:
        above = os.path.dirname(os.path.abspath(p.plot))
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ConfigError(f"plan.plot={p.plot}: {above} is a file, not a directory; choose another plan.plot")
        if not os.access(above, os.W_OK) or above.startswith(("/proc", "/sys")):
            raise ConfigError(f"plan.plot={p.plot}: {above} cannot be written; choose another plan.plot")


def answer_query(argv: list[str]) -> int:
    """Hydra's own questions, by a Hydra app over ``conf/plan.yaml`` (no torch)."""
    register_schemas(query=True)

    @hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
    def app(cfg: PlanConfig) -> None:  # never called: a question is answered before the job runs
        pass

    program = sys.argv[0]
    sys.argv = [program, *quote_numeric_choices(argv)]
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = [program, *argv]
    return 0


def buildable(cfg: PlanConfig) -> None:
    """The model builds (on the meta device: shapes only), or a ConfigError names what it said."""
    # lazy: these import torch, which Hydra's questions (answered by this module) never need
    from sharded_exp.launch.preflight import check_no_lazy, check_units_shardable
    from sharded_exp.plan.points import strategy_names
    from sharded_exp.predict.prediction import meta_model
    from sharded_exp.strategies import STRATEGIES

    try:
        module = meta_model(cfg.model, cfg.trainer.freeze)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the model's own complaint, named
        raise ConfigError(
            f"model={cfg.model.name} cannot be built with this config: {type(exc).__name__}: {exc}"
        ) from None
    if not any(p.requires_grad for p in module.parameters()):  # as a run refuses it: nothing to train
        raise ConfigError(
            f"model={cfg.model.name} has nothing to train (no parameter, or trainer.freeze={list(cfg.trainer.freeze)} "
            "freezes every one): there is nothing to plan"
        )
    check_no_lazy(module, cfg.model.name)
    for name in strategy_names(cfg):  # a layout training refuses is no plan (a weight tied across FSDP's units)
        if STRATEGIES.builder(name).traits.shards_parameters:
            try:
                check_units_shardable(module, cfg.model.name, name)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or plan without it: plan.strategies=[ddp,zero1,...]") from None


def preset_of(argv: list[str]) -> str:
    """The model preset the command line chose (``gpt_7b``, or the default ``mlp``) and the
    model keys it changed, each as given (``+model.hidden=64`` adds a key for a model of your
    own, and a run needs its ``+`` too): ``gpt_7b model.n_layers=80``."""
    chosen = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("model=")]
    changed = [a for a in argv if a.lstrip("+").startswith("model.")]
    return " ".join([chosen[-1] if chosen else "mlp", *changed])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if is_query(argv):
        return answer_query(argv)
    problem = misspelled(argv, "plan")  # a typo refused with the name meant, before torch
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # lazy: checking a model imports torch; a question (above) never does
    from sharded_exp.models.target import check_config_file, check_pretrained

    try:
        cfg = compose(argv, config_name="plan")
        check_plan(cfg, argv)
        if is_target_model(cfg.model):
            check_config_file(cfg.model)  # a config.json given alone is the architecture planned for
            check_pretrained(cfg.model)  # as is a save_pretrained directory's
        if cfg.plan.params is None:
            buildable(cfg)
    except (ConfigError, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except HydraException as exc:
        print(f"error: {composition_error(exc, argv)}", file=sys.stderr)
        return 2
    return plan(cfg, preset_of(argv), argv)


def plan(cfg: PlanConfig, preset: str, argv: list[str] = ()) -> int:
    """Plan the composed, checked ``cfg`` and print it in ``plan.format``; ``argv``: the command
    line it was composed from (``plan.find=fastest`` writes its run's overrides into the command
    line it answers with)."""
    # lazy: these import torch, which Hydra's questions (answered by this module) never need
    from sharded_exp.plan import fastest, points, speed
    from sharded_exp.plan.depth import shapes_of

    device_type = points._value(cfg.plan.device)
    if cfg.plan.params is not None:
        params = int(cfg.plan.params)
    else:
        shapes = shapes_of(cfg)
        params = sum(math.prod(s) for g in shapes.groups for s in g)
    world_sizes = list(cfg.plan.world_sizes)
    find = points._value(cfg.plan.find)
    total = len(points.points(cfg)) * len(world_sizes)
    total += len(fastest.searched(cfg, world_sizes)) if find == "fastest" else total if find else 0
    cfg = speed.measured_once(cfg)  # plan.remeasure: once for the plan, not once per point
    progress = Progress(total)
    try:
        rows = points.plan_rows(cfg, world_sizes, device_type, progress)
        found = []
        if find == "fastest":
            given = fastest.run_overrides(list(argv))
            found = fastest.fastest_rows(cfg, world_sizes, device_type, progress, "model=" + preset, given)
        elif cfg.plan.find:
            found = points.find_rows(cfg, world_sizes, device_type, progress)
    except ConfigError as exc:  # found by a fake step (a parameter made in forward): refused as a run would be
        progress.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    faked = points.faked(cfg)
    form = points._value(cfg.plan.format)
    machine = speed.describe(cfg)
    if form == "json":
        doc = {"params": params, "model": preset if cfg.plan.params is None else None, "device": device_type,
               "device_faked": faked, "speed_profile": machine, "columns": table.column_keys(rows), "rows": rows,
               "found": found,
               "cheapest": [{k: r[k] for k in ("strategy", "levers", "world_size", "total_gib")}
                            for r in points.cheapest(rows)] if cfg.plan.params is None else []}  # fmt: skip
        print(table.json_text(doc))
    elif form == "csv":
        print(table.csv_text(rows))
    else:
        columns = points._value(cfg.plan.columns)
        print(
            table.text(rows, found, cfg, params, preset, faked, markdown=form == "md", speed=machine, columns=columns)
        )
    if cfg.plan.plot:
        try:
            print(f"plan: chart {write_chart(rows, cfg, params)}", file=sys.stderr)
        except OSError as exc:
            print(f"error: plan.plot={cfg.plan.plot} not written: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


def write_chart(rows, cfg: PlanConfig, params: int) -> str:
    """``plan.plot``: the plan drawn (:func:`sharded_exp.output.charts.plan_chart`)."""
    # lazy: points imports torch, which Hydra's questions (answered by this module) never need
    from sharded_exp.plan.points import LEVER_COST, _value, lever_names, strategy_cost

    count = f"{params / 1e9:.3g} B" if params >= 1e8 else f"{params:,}"
    what = (f"raw parameter count ({count} params, no activations)" if cfg.plan.params is not None
            else f"model={cfg.model.name} ({count} params), batch {cfg.trainer.batch_size}/rank")  # fmt: skip
    title = (
        f"Planned peak per rank: {what}, precision {Precision.of(cfg)}, {cfg.optimizer.name}, {_value(cfg.plan.device)}"
    )
    cost = lambda r: sum(LEVER_COST[x] for x in lever_names(r.get("levers", "none")))  # noqa: E731
    order = sorted(rows, key=lambda r: (cost(r), strategy_cost(r["strategy"])))  # the legend: cheapest first
    path = Path(cfg.plan.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    charts.save(charts.plan_chart(order, cfg.plan.device_memory_gib, title), path)
    return str(path)
