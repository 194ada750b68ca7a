"""``plan.find=fastest``: per world size, the fastest configuration that fits, and the command
line that runs it.

The search: every planned strategy x lever combination x per-rank micro-batch x HSDP
replicate (for a strategy whose config has ``replicate``). The global batch is fixed at what
the configured ``trainer.batch_size`` x ``trainer.grad_accum`` gives each rank: a micro-batch
``b`` is a power-of-two divisor of those samples, and ``trainer.grad_accum`` makes up the rest.
HSDP is tried with one replica per node (shard within a node, replicate across nodes) where
the world spans nodes of ``plan.gpus_per_node``. Each candidate is a planned point (its peak
from fake steps, its speed from a traced step: :mod:`sharded_exp.plan.speed`); a candidate
fits by the table's own test (:func:`sharded_exp.plan.points.fits`), and the fastest by step
time wins (samples per step are the same for all). A candidate tried at several world sizes
is planned once for them all, and the candidates are planned side by side in ``plan.workers``
processes, as the table's points are.
"""

from __future__ import annotations

import shlex
from typing import Any

from sharded_exp.config import PlanConfig
from sharded_exp.errors import ConfigError
from sharded_exp.plan.points import (
    LEVERS,
    applies,
    lever_combos,
    lever_names,
    side_by_side,
    strategy_cost,
    strategy_names,
    task_rows,
    with_strategy,
    workers,
)
from sharded_exp.plan.progress import Progress
from sharded_exp.precision import Precision
from sharded_exp.strategies import STRATEGIES


def micro_batches(samples: int) -> list[int]:
    """The power-of-two divisors of ``samples`` (and ``samples`` itself), largest first."""
    found = {b for b in (2**i for i in range(samples.bit_length())) if samples % b == 0} | {samples}
    return sorted(found, reverse=True)


def replicas(cfg: PlanConfig, name: str, world_size: int) -> list[int]:
    """HSDP replica counts tried for strategy ``name`` at ``world_size``: 1, and one replica per
    node where the world spans whole nodes and the strategy has ``replicate``."""
    out = [1]
    per_node = int(cfg.plan.gpus_per_node)
    has = hasattr(STRATEGIES.config_class(name)(), "replicate")
    if has and world_size > per_node and world_size % per_node == 0:
        out.append(world_size // per_node)
    return out


def override_key(override: str) -> str:
    """The key a Hydra override sets: ``trainer.grad_clip`` of ``+trainer.grad_clip=0``,
    ``strategy`` of ``strategy=fsdp``."""
    return override.lstrip("+~").split("=", 1)[0]


def run_overrides(argv: list[str]) -> list[str]:
    """The overrides of a plan's command line that a training run takes as they are: all but
    the planner's own (``plan.*``, ``hydra.*``) and the model's (the preset and its keys are
    written apart: :func:`~sharded_exp.plan.command.preset_of`)."""
    return [a for a in argv if not override_key(a).startswith(("plan.", "hydra.", "hydra/", "model"))]


def command(model: str, cfg: PlanConfig, c: PlanConfig, combo: str, world_size: int, given: list[str] = ()) -> str:
    """The ``sharded-exp`` command line that runs candidate ``c``: the model, the overrides the
    plan was given (``given``: :func:`run_overrides`; those of the configured strategy only where
    it is the candidate's, whose settings it was planned with), then what the candidate sets."""
    sets = [f"precision={Precision.of(c)}", f"optimizer={c.optimizer.name}", f"strategy={c.strategy.name}",
            f"trainer.world_size={world_size}", f"trainer.batch_size={c.trainer.batch_size}",
            f"trainer.grad_accum={c.trainer.grad_accum}"]  # fmt: skip
    for lever in lever_names(combo):
        key, value = LEVERS[lever]
        sets.append(f"strategy.{key}={str(value).lower()}" if key == "cpu_offload" else f"trainer.{key}={value}")
    if int(c.strategy.get("replicate", 1) or 1) > 1:
        sets.append(f"strategy.replicate={c.strategy.replicate}")
    taken = {override_key(s) for s in sets}
    mine = c.strategy.name == cfg.strategy.name
    kept = [a for a in given if override_key(a) not in taken and (mine or not override_key(a).startswith("strategy."))]
    return shlex.join(["sharded-exp", *model.split(), *kept, *sets])  # pasted into a shell: quoted where it must be


def candidates(cfg: PlanConfig, world_size: int):
    """(strategy, lever combination, config) of every candidate at ``world_size``."""
    samples = int(cfg.trainer.batch_size) * int(cfg.trainer.grad_accum)
    for name in strategy_names(cfg):
        for combo in lever_combos(cfg):
            if not applies(name, combo):
                continue
            for b in micro_batches(samples):
                for r in replicas(cfg, name, world_size):
                    c = with_strategy(cfg, name, combo)
                    c.trainer.batch_size, c.trainer.grad_accum = b, samples // b
                    if r > 1:
                        c.strategy.replicate = r
                    try:
                        STRATEGIES.builder(name).check(c.strategy, world_size, str(cfg.plan.device))
                    except ConfigError:
                        continue
                    yield name, combo, c


def searched(cfg: PlanConfig, world_sizes) -> dict[tuple, tuple]:
    """Every candidate to plan, once for all the world sizes it is tried at:
    ``(strategy, lever combination, micro-batch, replicate) -> (strategy, combination, config,
    [world sizes])``."""
    groups: dict[tuple, tuple] = {}
    for ws in world_sizes:
        for name, combo, c in candidates(cfg, ws):
            tried = groups.setdefault(_key(name, combo, c), (name, combo, c, []))[3]
            if ws not in tried:  # a configured strategy.replicate equal to one replica per node: one candidate
                tried.append(ws)
    return groups


def _key(name: str, combo: str, c: PlanConfig) -> tuple:
    return name, combo, int(c.trainer.batch_size), int(c.strategy.get("replicate", 1) or 1)


def fastest_rows(
    cfg: PlanConfig, world_sizes, device_type: str, progress: Progress | None = None, model: str = "",
    given: list[str] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """Per world size, the fastest candidate that fits (see the module docstring), with the
    command line that runs it (``given``: the plan's own overrides a run takes, :func:`command`).
    The candidates are planned side by side in ``plan.workers`` processes
    (:func:`~sharded_exp.plan.points.side_by_side`), the costliest strategies first."""
    model = model or f"model={cfg.model.name}"
    groups = searched(cfg, world_sizes)
    order = sorted(groups, key=lambda k: -strategy_cost(k[0]))
    # each candidate's rows as a table's task makes them: peaks composed once for its world sizes
    calls = [(task_rows, groups[k][2], *groups[k][:2], groups[k][3], device_type) for k in order]
    rows: dict[tuple, list[dict[str, Any]]] = {}
    for i, result in side_by_side(workers(cfg, len(calls)), calls):
        rows[order[i]] = result
        if progress is not None:
            name, combo, batch, replicate = order[i]
            label = f"{name}{'' if combo == 'none' else ' + ' + combo} batch {batch}"
            progress.done(1, f"fastest: {label}{f' replicate {replicate}' if replicate > 1 else ''}")
    out = []
    for ws in world_sizes:
        best, tried = None, 0
        for name, combo, c in candidates(cfg, ws):  # in the search's order: the first of equals wins
            key = _key(name, combo, c)
            row = rows[key][groups[key][3].index(ws)]
            tried += 1
            if row["fits"] and row.get("step_time_s") and (best is None or row["step_time_s"] < best[0]["step_time_s"]):
                best = (row, command(model, cfg, c, combo, ws, given), c)
        out.append(_found(ws, best, tried))
    return out


def _found(world_size: int, best, tried: int) -> dict[str, Any]:
    if best is None:
        return {"find": "fastest", "world_size": world_size, "value": None, "command": None,
                "note": f"none of {tried} candidates fits with a predicted step time"}  # fmt: skip
    row, line, c = best
    keys = ("strategy", "levers", "step_time_s", "exposed_comm_s", "tokens_per_s_per_device", "mfu_pct", "total_gib")
    return {"find": "fastest", "world_size": world_size, **{k: row.get(k) for k in keys},
            "batch_size": int(c.trainer.batch_size), "grad_accum": int(c.trainer.grad_accum),
            "replicate": int(c.strategy.get("replicate", 1) or 1), "value": row["strategy"], "command": line,
            "note": f"fastest of {tried} candidates"}  # fmt: skip
