"""The planned points: every rank's peak for each strategy, lever and world size.

For a configured model each point is the fake training step every run makes in its parent
(:mod:`sharded_exp.predict.fake_step`), composed by depth for a deep model
(:mod:`sharded_exp.plan.depth`). For a raw parameter count (``plan.params``) there is no
model to run: the count is an ideally divisible model (``plan.units`` equal blocks, each
split into one equal tensor per rank: the ZeRO paper's assumption) under each strategy's
analytic memory model, without activations.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
from typing import Any, Iterator

from omegaconf import OmegaConf

from sharded_exp.config import PlanConfig
from sharded_exp.measure import machine_memory
from sharded_exp.measure.cuda_kernels import cublas_workspace_mib
from sharded_exp.plan.depth import first_depth, peaks_by_depth, shapes_of
from sharded_exp.plan.progress import Progress
from sharded_exp.plan.speed import SPEED_KEYS, profile_name, speed_columns, traced
from sharded_exp.precision import Precision
from sharded_exp.predict.alloc_trace import alloc_conf_of, context_source, cuda_context, replayable
from sharded_exp.predict.host_memory import node_mib
from sharded_exp.predict.prediction import ModelShapes, model_shapes, offload_host, predict, predict_peak
from sharded_exp.speed.profiles import load_device
from sharded_exp.strategies import STRATEGIES, memory_of, sharding_order, traits_of
from sharded_exp.vocabulary.memory import PARTS

GIB = 2**30
MIB = 2**20


def _value(option) -> str | None:
    return None if option is None else str(option)


def strategy_names(cfg: PlanConfig) -> list[str]:
    return list(cfg.plan.strategies) if cfg.plan.strategies else STRATEGIES.names()


LEVERS = {"ac": ("activation_checkpointing", "full"), "ac_selective": ("activation_checkpointing", "selective"),
          "ac_selective_op": ("activation_checkpointing", "selective_op"), "offload": ("cpu_offload", True)}  # fmt: skip
"""The planner's lever names (``plan.levers`` entries join them with +) and what each sets."""
LEVER_COST = {"none": 0, "ac_selective": 1, "ac_selective_op": 1, "ac": 2, "offload": 3}
"""Extra recompute or traffic each lever costs, in the order a user would reach for them."""


def strategy_cost(name: str) -> int:
    """Extra communication per strategy, DDP < ZeRO-1 < ZeRO-2 < FSDP: how much it shards
    (:func:`~sharded_exp.strategies.sharding_order`; not registered: the costliest)."""
    return sharding_order(name)[0]


def lever_names(combo: str) -> list[str]:
    return [] if combo == "none" else combo.split("+")


def applies(name: str, combo: str) -> bool:
    """Offload is FSDP's (fsdp, fsdp_grad_op); the others apply to every strategy."""
    return "offload" not in lever_names(combo) or traits_of(name).shards_parameters


def with_strategy(cfg: PlanConfig, name: str, combo: str = "none"):
    out = cfg.copy()
    if cfg.strategy.name != name:  # the configured strategy keeps its settings (strategy.replicate=2: HSDP)
        out.strategy = STRATEGIES.config_class(name)()
    for lever in lever_names(combo):
        key, value = LEVERS[lever]
        if key == "cpu_offload":
            out.strategy.cpu_offload = value
        else:
            out.trainer[key] = value
    return out


def even_split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` integers that differ by at most one, the larger first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def raw_shapes(params: int, units: int, world_size: int, row_sharded: bool = False) -> ModelShapes:
    """``params`` as an ideally divisible model of exactly ``params`` elements: ``units``
    blocks as equal as integers allow (no more blocks than elements), each split into one
    1-D tensor per rank (no more tensors than its elements: every rank's owner share and
    bucket share come out equal, up to one element), or, for a strategy that shards every
    tensor (``row_sharded``: FSDP), each block one 1-D tensor that the strategy splits into
    its padded shards as FSDP does. The first rank holds the largest share: rank 0 stands
    for all."""
    blocks = even_split(params, min(units, params))
    if row_sharded:
        return ModelShapes([[(n,) for n in blocks]], blocks, 0, {})
    pieces = [(size,) for n in blocks for size in even_split(n, min(world_size, n))]
    return ModelShapes([pieces], blocks, 0, {})


def _raw_parts(cfg: PlanConfig, name: str, world_size: int) -> dict[str, float]:
    """Rank 0's model states (GiB) for ``plan.params`` as an ideally divisible model."""
    cfg_s = with_strategy(cfg, name)
    row_sharded = traits_of(name).shards_parameters
    shapes = raw_shapes(int(cfg.plan.params), int(cfg.plan.units), world_size, row_sharded)
    # Every rank holds the same by construction: rank 0 stands for all.
    prediction = predict(cfg_s.strategy, cfg.optimizer, Precision.of(cfg), shapes, world_size, ranks=[0])
    states = prediction["model_states_mib"][0]
    parts = {k: states[k] * MIB / GIB for k in ("params", "grads", "optimizer")}
    # The strategy's communication buckets, as a model plan's fake step files them: beside
    # the gradients, or holding them (ShardedDDP's; DDP's with gradient_as_bucket_view).
    memory = memory_of(name)
    numels = [math.prod(s) for g in shapes.groups for s in g]
    owners = memory.partition([[math.prod(s) for s in g] for g in shapes.groups], world_size)
    held, aliased = memory.bucket_numel(cfg_s.strategy, numels, owners, 0, world_size)
    parts["grads"] -= aliased * shapes.element_bytes / GIB
    parts["buckets"] = held * shapes.element_bytes / GIB
    return parts | {"gathered": prediction["transient_params_mib"] * MIB / GIB}


EXACT_UP_TO = 1024
"""World sizes up to this are planned tensor by tensor; beyond it, from a line."""
LINE_WINDOWS = ((256, 512, 1024), (4096, 8192, 16384))
"""Exact plans a line is drawn through (two) and checked at (the third): the first window whose
check holds answers beyond it. A strategy whose figures change regime (ShardedDDP's buckets
fill once a rank's share of each unit is small) is linear again past the change."""
MAX_UNITS = 100_000
"""plan.units at most: a unit is a tensor per rank in the raw model (a transformer's layers are
tens to hundreds)."""


class NoLine(ValueError):
    """A strategy's figures for a raw count are not a + b / world_size in any window."""


def _raw_parts_at_scale(cfg: PlanConfig, name: str, world_size: int) -> tuple[dict[str, float], str]:
    """Each figure of an ideally divisible model is held whole or split evenly, so it is
    a + b / world_size: two exact plans give the line, a third checks it, and the line
    answers for any world size in milliseconds (:data:`LINE_WINDOWS`, seconds at most).
    Where no window's check holds, :class:`NoLine` says so: an exact plan at millions of
    ranks would take minutes and gigabytes."""
    for w1, w2, w3 in LINE_WINDOWS:
        if world_size <= w3:
            return _raw_parts(cfg, name, world_size), ""
        p1, p2, p3 = (_raw_parts(cfg, name, w) for w in (w1, w2, w3))
        line = {}
        for k in p1:
            b = (p1[k] - p2[k]) / (1 / w1 - 1 / w2)
            a = p1[k] - b / w1
            if not math.isclose(a + b / w3, p3[k], rel_tol=1e-4, abs_tol=1e-9):  # rounding of the pieces
                break
            line[k] = max(0.0, a + b / world_size)
        else:
            return line, f"from the exact plans at {w1}, {w2} and {w3} ranks (every figure is a + b/world_size)"
    raise NoLine(
        f"{name}: a raw count is planned up to {LINE_WINDOWS[-1][-1]:,} ranks for this strategy (its figures are not "
        f"a + b/world_size there); {world_size:,} ranks was asked"
    )


def raw_row(cfg: PlanConfig, name: str, world_size: int) -> dict[str, Any]:
    if world_size <= EXACT_UP_TO:
        states, note = _raw_parts(cfg, name, world_size), ""
    else:
        try:
            states, note = _raw_parts_at_scale(cfg, name, world_size)
        except NoLine as exc:  # said in its row, as a point without a peak is
            row = _row(cfg, name, world_size, {k: None for k in PARTS}, "none", str(exc))
            return row | {"total_gib": None, "mean_gib": None, "fits": None, **allocator_columns(None, None)}
    parts = {k: 0.0 for k in PARTS} | states | {"activations": None}
    return _row(cfg, name, world_size, parts, "raw parameter count (analytic, no activations)", note)


LAYER_KEYS = ("n_layers", "config.num_hidden_layers", "config.n_layer")
"""Where a model keeps its number of identical blocks (ours; Hugging Face's configs)."""


def _layer_key(model_cfg) -> str | None:
    for key in LAYER_KEYS:
        if isinstance(OmegaConf.select(model_cfg, key, default=None), int):
            return key
    return None


def depth_of(cfg: PlanConfig, name: str) -> tuple[str, int] | None:
    """(key, blocks) when ``cfg``'s model is deep enough to be composed by depth under
    strategy ``name`` (``plan.by_depth``), else None: it is faked whole."""
    key = _layer_key(cfg.model)
    layers = OmegaConf.select(cfg.model, key) if key else 0
    if cfg.trainer.get("freeze"):  # patterns may name blocks a shallow fake has not got (blocks_.7.*)
        return None
    if key and cfg.plan.by_depth and layers > first_depth(name) + 2:
        return key, layers
    return None


def composed_peaks(
    cfg: PlanConfig, name: str, world_sizes, device_type: str, combo: str = "none"
) -> dict[int, dict | None]:
    """The peaks of strategy ``name`` (with lever ``combo``) at every world size, composed
    by depth where the model allows it (None where it is to be faked whole)."""
    deep = depth_of(cfg, name)
    if deep is None:
        return {ws: None for ws in world_sizes}
    return peaks_by_depth(with_strategy(cfg, name, combo), list(world_sizes), device_type, *deep)


SHARE_UNDER = 0.10
"""How close under the device's memory a composed row may come while its reserved memory is
the shallow fake's share of the peak (:func:`~sharded_exp.plan.depth.compose_allocator`:
its trace could not be drawn to full depth) before the model is faked whole to settle
``fits``. That share was found from 6.7% under (ShardedDDP on a 7B GPT at 64 ranks) to 15%
over (FSDP on a 24-block GPT) the model faked whole (docs/figures.md), so a row it puts
within 10% under the device's memory may not fit; one it puts over may fit, and is said not
to (the safe side)."""

SETTLED = (
    f"faked whole: composed, its reserved memory (the shallow fake's share of the peak) came within "
    f"{SHARE_UNDER:.0%} under the device's memory"
)


def settled_whole(peak: dict[str, Any], device_memory_gib: float) -> bool:
    """Whether a composed ``peak`` is to be faked whole before its row is held against
    ``device_memory_gib``: its allocator figures are the share of the peak (not replayed over a
    drawn trace) and its device total comes within :data:`SHARE_UNDER` under that memory."""
    allocator = peak.get("allocator")
    if peak.get("per_rank_mib") is None or not allocator or not allocator.get("share_of_peak"):
        return False
    basis = allocator_columns(max(peak["per_rank_mib"]) * MIB / GIB, allocator)["device_total_gib"]
    return (1 - SHARE_UNDER) * device_memory_gib < basis <= device_memory_gib


def _settled(composed: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """The peak a row settled by :func:`settled_whole` takes: the whole model's, its note saying
    why and its seconds counting the shallow fakes too; the composed one, saying so, where the
    whole model could not be faked."""
    if whole["per_rank_mib"] is None:
        why = f"not settled: the whole model could not be faked ({whole['error']})"
        return {**composed, "note": "; ".join(n for n in (composed.get("note"), why) if n)}
    seconds = (whole.get("seconds") or 0.0) + (composed.get("seconds") or 0.0)
    return {**whole, "note": "; ".join(n for n in (whole.get("note"), SETTLED) if n), "seconds": seconds}


def model_row(cfg: PlanConfig, name: str, world_size: int, shapes: ModelShapes, device_type: str, combo: str = "none",
              peak: dict | None = None, traced: dict | None = None):  # fmt: skip
    """One planned point; ``peak``: its composed peak (:func:`composed_peaks`), else (or where
    :func:`settled_whole` says so) one fake step of the whole model; ``traced``: the strategy's traced step
    (:func:`sharded_exp.plan.speed.traced`) its speed columns come from (None: none)."""
    cfg_s = with_strategy(cfg, name, combo)
    prediction = predict(cfg_s.strategy, cfg.optimizer, Precision.of(cfg), shapes, world_size)
    if peak is None:
        peak = composed_peaks(cfg, name, [world_size], device_type, combo)[world_size]
    settle = peak is not None and settled_whole(peak, cfg.plan.device_memory_gib)
    if peak is None or settle:
        whole = predict_peak(cfg_s, world_size, device_type, prediction, shapes, flops=False)
        peak = _settled(peak, whole) if settle else whole
    states = max(sum(p.values()) for p in prediction["model_states_mib"])
    if peak["per_rank_mib"] is None:
        parts = {k: None for k in PARTS}
        row = _row(cfg, name, world_size, parts, "none", peak["error"])
        row["total_gib"], row["mean_gib"], row["fits"] = None, None, None
        row |= allocator_columns(None, None)
    else:
        parts = {k: v * MIB / GIB for k, v in peak["breakdown_mib"].items()}
        row = _row(cfg, name, world_size, parts, peak["method"], peak["note"])
        row["total_gib"] = max(peak["per_rank_mib"]) * MIB / GIB  # the peak itself
        # the average over ranks (the seed study's figure): below the peak where shards are uneven
        row["mean_gib"] = sum(peak["per_rank_mib"]) / len(peak["per_rank_mib"]) * MIB / GIB
        if "offload" in lever_names(combo):  # CPU offload: the rank's states are in host memory
            row |= host_columns(cfg_s, shapes, world_size)
        row |= allocator_columns(row["total_gib"], peak.get("allocator"))
        if device_type == "cuda" and peak.get("allocator") is None and not replayable(alloc_conf_of(cfg)):
            row |= unmodelled_allocator(row["total_gib"], alloc_conf_of(cfg))
        row["fits"] = fits(row, cfg.plan.device_memory_gib)
        if not host_fits(row):
            row["note"] = "; ".join(n for n in (row["note"], (
                f"offload: the node's ranks pin and hold {row['host_node_gib']:,.2f} GiB of host memory, more than "
                f"its {row['host_memory_gib']:,g} GiB ({row['host_memory_basis']})")) if n)  # fmt: skip
        row["seconds"] = peak["seconds"]
        # each phase's peak (forward/backward "step", "optimizer"): plan.find follows them
        row["phases_gib"] = {name: v[0] * MIB / GIB for name, v in (peak.get("phases_mib") or {}).items()}
    row["model_states_gib"] = states * MIB / GIB  # analytic: what every run predicts and checks
    row["levers"] = combo
    row["cost"] = _cost_note(combo, prediction, bool(getattr(cfg_s.strategy, "reshard_after_forward", True)))
    if traced is not None:
        row.update(speed_columns(cfg_s, world_size, traced, prediction))
    return row


def _cost_note(combo: str, prediction, regathers: bool = True) -> str:
    """What a lever costs in step time, where it is known without running (``regathers``: the
    strategy gathers each unit again for its backward, so offload copies its shard in twice)."""
    notes = []
    levers = lever_names(combo)
    if "ac" in levers:
        notes.append("recompute: one more forward of every unit (about +1/3 of the step's FLOPs)")
    if "ac_selective" in levers:
        notes.append("recompute: the units' cheap ops (norms, activations) again in the backward")
    if "ac_selective_op" in levers:
        notes.append(
            "recompute: the units' cheap ops and every second matmul again in the backward (torchtitan's op policy)"
        )
    if "offload" in levers:
        mine = max(prediction["model_states_mib"], key=lambda p: sum(p.values()))
        copies_in = 2 if regathers else 1
        moved = (copies_in * mine["params"] + mine["grads"]) * MIB / GIB
        into = "in before each gather (forward and backward)" if regathers else "in"
        notes.append(f"offload: {moved:.2f} GiB host<->device per step (sharded parameters {into}, gradients out)")
    return "; ".join(notes)


def _row(cfg: PlanConfig, name, world_size, parts, method, note) -> dict[str, Any]:
    total = sum(v for v in parts.values() if v is not None)
    row = {
        "strategy": name,
        "world_size": world_size,
        **{f"{k}_gib": v for k, v in parts.items()},
        "total_gib": total,
        "mean_gib": total,  # every rank alike (a raw count's ideally divisible model); a model's row sets its own
        **allocator_columns(total, None),
        "method": method,
        "note": note,
        **{k: None for k in SPEED_KEYS},  # a model's row sets them from its traced step
    }
    row["fits"] = fits(row, cfg.plan.device_memory_gib)
    return row


def host_columns(cfg: PlanConfig, shapes: ModelShapes, world_size: int) -> dict[str, Any]:
    """An offloaded row's host memory (CPU offload): ``host_gib``, the fullest rank's, as
    torch's pinned-memory allocator and the host's optimizer step hold it
    (:func:`~sharded_exp.predict.prediction.offload_host`), ``host_node_gib``, what the fullest
    node's ranks hold together, and ``host_memory_gib``, the node's memory it is held against
    (:func:`host_budget_gib`; None: unchecked)."""
    per_rank, parts = offload_host(cfg, shapes, world_size)
    budget, basis = host_budget_gib(cfg)
    ranks_on_node = min(world_size, int(cfg.plan.get("gpus_per_node", 8)))
    return {
        "host_gib": max(per_rank) * MIB / GIB,
        "host_node_gib": node_mib(per_rank, ranks_on_node) * MIB / GIB,
        "host_pinned_gib": parts["pinned"] * MIB / GIB,
        "host_memory_gib": budget,
        "host_memory_basis": basis,
    }


def host_budget_gib(cfg: PlanConfig) -> tuple[float | None, str]:
    """The host memory per node (GiB) an offloaded row's ``host_node_gib`` is held against, and
    where it comes from: ``plan.host_memory_gib``, else the planned profile's server
    (``server_memory_GiB``), else, for ``this``, this machine's; (None, why) where none is known."""
    given = cfg.plan.get("host_memory_gib", None)
    if given is not None:
        return float(given), "plan.host_memory_gib"
    name = profile_name(cfg)
    if name == "this":
        total = machine_memory.total_mib()
        return (total / 1024, "this machine's memory") if total else (None, "this machine's memory could not be read")
    host = load_device(name).host_memory
    if host is None or host.capacity_gib is None:
        return None, f"{name} states no server memory: set plan.host_memory_gib"
    return host.capacity_gib.value, f"{name}'s server"


def allocator_columns(total_gib: float | None, allocator: dict | None) -> dict[str, Any]:
    """A row's allocator columns from its peak (``total_gib``) and the caching allocator's
    figures (:func:`~sharded_exp.predict.alloc_trace.point_figures`). Without them (a CPU plan:
    no caching allocator; a raw count: nothing faked) allocated is the tensors' bytes and
    there is no reserved or device total."""
    if total_gib is None or allocator is None:
        return {"allocated_gib": total_gib, "reserved_gib": None, "device_total_gib": None}
    reserved = total_gib + allocator["reserved_extra_mib"] * MIB / GIB
    return {
        "allocated_gib": total_gib + allocator["allocated_extra_mib"] * MIB / GIB,
        "reserved_gib": reserved,
        "device_total_gib": reserved + allocator["context_mib"] * MIB / GIB,
        "fragmentation_gib": allocator["fragmentation_mib"] * MIB / GIB,
        "context_gib": allocator["context_mib"] * MIB / GIB,
        "context_source": allocator["context_source"],
        "alloc_conf": allocator["alloc_conf"],
        "streams": allocator["streams"],
    }


def unmodelled_allocator(total_gib: float, alloc_conf: str | None) -> dict[str, Any]:
    """A CUDA row whose allocator setting is not torch's caching allocator (``backend:cudaMallocAsync``:
    the driver's pool, not modelled): no reserved figure, but the CUDA context still comes on top
    of the tensors, so :func:`fit_basis` holds their sum (a floor of what nvidia-smi shows)
    against the device."""
    context = cuda_context()
    return {
        "allocated_gib": total_gib,
        "reserved_gib": None,
        "device_total_gib": None,
        "context_gib": context["mib"] * MIB / GIB,
        "context_source": context_source(context),
        "alloc_conf": alloc_conf,
    }


def fit_basis(row: dict[str, Any]) -> float | None:
    """The figure a row is held against the device's memory with: the device total (what
    nvidia-smi shows, what a CUDA run OOMs on) where the allocator was modelled; the tensors'
    peak plus the CUDA context on CUDA where it was not (:func:`unmodelled_allocator`); else
    (CPU) the tensors' peak; None without a peak."""
    if row.get("device_total_gib") is not None:
        return row["device_total_gib"]
    total = row.get("total_gib")
    return total + row["context_gib"] if total is not None and row.get("context_gib") is not None else total


def fits(row: dict[str, Any], device_memory_gib: float) -> bool | None:
    """Whether a planned point fits ``plan.device_memory_gib`` (:func:`fit_basis`), and, offloaded,
    its node's host memory (:func:`host_fits`); None when it has no peak. The table, ``plan.find``
    (batch size, depth, fastest) and the cheapest-that-fits search all ask this (``plan.find``'s
    probes through :func:`within`, on the same basis)."""
    device = within(fit_basis(row), device_memory_gib)
    return device and host_fits(row) if device is not None else None


def host_fits(row: dict[str, Any]) -> bool:
    """An offloaded row's node holds its ranks' host memory (``host_node_gib`` within
    ``host_memory_gib``); True where nothing is offloaded or no budget is known (said in its
    ``host_memory_basis``)."""
    need, budget = row.get("host_node_gib"), row.get("host_memory_gib")
    return need is None or budget is None or need <= budget


def within(basis_gib: float | None, device_memory_gib: float) -> bool | None:
    """The budget test itself, on a row's :func:`fit_basis`; None without a figure."""
    return None if basis_gib is None else basis_gib <= device_memory_gib


def lever_combos(cfg: PlanConfig) -> list[str]:
    return [str(c) for c in cfg.plan.get("levers", None) or ["none"]]


def points(cfg: PlanConfig) -> list[tuple[str, str]]:
    """The (strategy, lever combination) pairs planned, in order."""
    combos = lever_combos(cfg) if cfg.plan.params is None else ["none"]
    return [(name, combo) for name in strategy_names(cfg) for combo in combos if applies(name, combo)]


def plan_rows(
    cfg: PlanConfig, world_sizes, device_type: str = "cpu", progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Every planned point's row, in the order of :func:`points` then ``world_sizes``; the
    strategies are faked side by side in ``plan.workers`` processes (:func:`workers`), each
    strategy's rows and their speed columns (:func:`task_speed`) as two tasks. A raw
    parameter count (``plan.params``) fakes nothing and runs in this process."""
    world_sizes = list(world_sizes)
    tasks = points(cfg)
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def done(task, rows) -> None:
        found[task] = rows
        if progress is not None:
            label = f"{task[0]}{'' if task[1] == 'none' else ' + ' + task[1]}"
            progress.done(len(rows), label if len(rows) > 1 else f"{label} x{world_sizes[0]}")

    count = workers(cfg, len(tasks))
    if count > 1:
        # the costliest first (FSDP's fake steps), so that the last to finish is a short one;
        # each point's traced step (its speed columns) is a task of its own, after them all
        order = sorted(tasks, key=lambda t: -strategy_cost(t[0]))
        calls = [(task_rows, cfg, *t, world_sizes, device_type, False) for t in order]
        calls += [(task_speed, cfg, *t, world_sizes, device_type) for t in order]
        parts: dict[tuple[str, str], dict[str, list]] = {t: {} for t in tasks}
        for i, result in side_by_side(count, calls):
            task, part = order[i % len(order)], "rows" if i < len(order) else "speed"
            parts[task][part] = result
            if part == "rows":  # said as its rows come: the speed tasks run after them all
                done(task, result)
        for task in tasks:
            for row, speed in zip(parts[task]["rows"], parts[task]["speed"]):
                row.update(speed)
    else:
        for task in tasks:
            done(task, task_rows(cfg, *task, world_sizes, device_type))
    return [row for task in tasks for row in found[task]]


def side_by_side(count: int, calls: list[tuple]) -> Iterator[tuple[int, Any]]:
    """``(index, result)`` of each call in ``calls`` (``(function, *args)``) as it finishes, in
    ``count`` processes forked from a server that has imported the planner; in this process, in
    order, where ``count`` is 1. The functions and their arguments are pickled: module-level
    functions of the planner and its configs."""
    if count <= 1:
        for i, (fn, *args) in enumerate(calls):
            yield i, fn(*args)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sharded_exp.plan.points"])
    pool = concurrent.futures.ProcessPoolExecutor(count, mp_context=context)
    try:
        futures = {pool.submit(fn, *args): i for i, (fn, *args) in enumerate(calls)}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    finally:  # a call that raised (or a caller that stopped early): the calls not begun are dropped
        pool.shutdown(wait=True, cancel_futures=True)


SIDE_BY_SIDE_FROM = 10**8
"""Parameters from which ``plan.workers=0`` fakes side by side: a smaller model's fake steps
take less than the second or two a worker process takes to start."""


def workers(cfg: PlanConfig, tasks: int) -> int:
    """How many processes fake side by side: ``plan.workers``, or (0) one per CPU core this
    process may use for a model of :data:`SIDE_BY_SIDE_FROM` parameters or more; never more
    than there are strategies to fake (a raw count fakes none): a strategy's traced step (its
    speed columns, a task of its own) takes less than a process takes to start."""

    if cfg.plan.params is not None:
        return 1
    wanted = int(cfg.plan.get("workers", 1))
    if wanted == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        wanted = cores if shapes_of(cfg).params >= SIDE_BY_SIDE_FROM else 1
    return max(1, min(wanted, tasks))


def task_rows(
    cfg: PlanConfig, name: str, combo: str, world_sizes, device_type: str, speed: bool = True
) -> list[dict[str, Any]]:
    """The rows of one strategy and lever combination at every world size; ``speed=False``:
    without their speed columns (:func:`task_speed` makes them)."""
    if cfg.plan.params is not None:
        return [raw_row(cfg, name, ws) for ws in world_sizes]
    shapes = shapes_of(cfg)
    composed = composed_peaks(cfg, name, world_sizes, device_type, combo)
    found = traced(with_strategy(cfg, name, combo), device_type, _layer_key(cfg.model)) if speed else None
    return [model_row(cfg, name, ws, shapes, device_type, combo, composed[ws], found) for ws in world_sizes]


def task_speed(cfg: PlanConfig, name: str, combo: str, world_sizes, device_type: str) -> list[dict[str, Any]]:
    """The speed columns of one strategy and lever combination at every world size, from its
    traced step (:func:`~sharded_exp.plan.speed.traced`): what :func:`model_row` adds to a row
    given that step, made apart so that another process can make it."""
    cfg_s = with_strategy(cfg, name, combo)
    found = traced(cfg_s, device_type, _layer_key(cfg.model))
    shapes = shapes_of(cfg)
    return [
        speed_columns(cfg_s, ws, found, predict(cfg_s.strategy, cfg.optimizer, Precision.of(cfg), shapes, ws))
        for ws in world_sizes
    ]


def cheapest(rows) -> list[dict[str, Any]]:
    """Per world size, the planned point that fits with the least extra communication and
    recompute: strategies DDP < ZeRO-1 < ZeRO-2 < FSDP, then levers none < selective AC <
    AC < offload (a lever costs more than any strategy)."""
    out = []
    for ws in sorted({r["world_size"] for r in rows}):
        fitting = [r for r in rows if r["world_size"] == ws and r.get("fits")]
        if fitting:
            key = lambda r: (sum(LEVER_COST[x] for x in lever_names(r.get("levers", "none"))),  # noqa: E731
                             strategy_cost(r["strategy"]), r["total_gib"])  # fmt: skip
            out.append(min(fitting, key=key))
    return out


def _peak_gib(cfg: PlanConfig, world_size: int, device_type: str, errors: list[str], combo: str = "none"):
    """The largest rank's predicted peak in GiB, or None (why is appended to ``errors``),
    and the faked rank's peak in each phase."""
    shapes = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    row = model_row(cfg, cfg.strategy.name, world_size, shapes, device_type, combo)  # drawn by depth where it can be
    if row["total_gib"] is None:
        errors.append(row["note"])
        return None, {}, None
    # held against the budget as fits() holds it: each phase's line shifted by the allocator's share
    basis = fit_basis(row)
    host = (row["host_node_gib"], row["host_memory_gib"]) if row.get("host_memory_gib") is not None else None
    return basis, {k: v + basis - row["total_gib"] for k, v in (row.get("phases_gib") or {}).items()}, host


def largest(
    cfg: PlanConfig, name: str, world_size: int, knob: str, device_type: str, limit: int = 1 << 20, combo: str = "none"
) -> dict[str, Any]:
    """The largest value of ``knob`` (``trainer.batch_size`` or ``model.n_layers``) at which
    ``name`` fits ``plan.device_memory_gib`` on ``world_size`` ranks.

    The peak grows about linearly in either (activations per sample; states and
    activations per layer): fake steps at 1 and 2 give a line, and each next fake step is
    where the line through the two probes nearest the budget crosses it (regula falsi,
    integer-rounded), until the answer fits and one above does not. Four fake steps when
    the peak is linear; a few more when it bends. Under CPU offload the node's host memory
    (:func:`host_fits`) caps it too: it does not grow with the batch, and grows by the same
    pinned blocks with each layer, so the probes at 1 and 2 give its line exactly.
    """
    budget = cfg.plan.device_memory_gib
    section, key = knob.split(".")
    probes: dict[int, float | None] = {}
    phases: dict[int, dict[str, float]] = {}
    hosts: dict[int, tuple[float, float] | None] = {}
    errors: list[str] = []

    def peak(value: int) -> float | None:
        if value not in probes:
            c = with_strategy(cfg, name)
            c[section][key] = value
            probes[value], phases[value], hosts[value] = _peak_gib(c, world_size, device_type, errors, combo)
        return probes[value]

    one, two = peak(1), peak(2)
    if one is None or two is None:
        return {"value": None, "probes": probes, "note": f"no fake step: {errors[0]}"}
    if not within(one, budget):
        return {"value": 0, "probes": probes, "note": f"{knob}=1 does not fit"}
    capped = host_cap(hosts[1], hosts[2])
    if capped is not None and capped < 1:
        return {"value": 0, "probes": probes, "note": f"{knob}=1 does not fit the node's host memory (CPU offload)"}
    limit = min(limit, capped) if capped is not None else limit
    lo, hi = (2, None) if within(two, budget) and limit >= 2 else (1, 2)  # largest known to fit, smallest known not to
    while (hi is None or hi > lo + 1) and lo < limit:
        guess = _crossing(probes, phases, budget, lo, hi)
        guess = min(max(guess, lo + 1), hi - 1 if hi is not None else limit)
        p = peak(guess)
        lo, hi = (guess, hi) if within(p, budget) else (lo, guess)
    note = f"checked by fake steps at {lo} and {hi}" if hi is not None else f"fits up to the limit {limit}"
    if capped is not None and lo == capped and (hi is None or hi > capped):
        note = f"the node's host memory (CPU offload) holds {knob}={capped} and no more"
    return {"value": lo, "probes": probes, "note": note}


def host_cap(one: tuple[float, float] | None, two: tuple[float, float] | None) -> int | None:
    """The largest value whose node holds its host memory (CPU offload), from its line through
    the probes at 1 and 2 (``(host_node_gib, host_memory_gib)`` each); None where the host is
    not checked or does not grow (a batch), so does not cap. 0: not even 1 fits."""
    if one is None or two is None:
        return None
    (h1, budget), (h2, _) = one, two
    if h1 > budget:
        return 0
    if h2 <= h1:
        return None
    return 1 + math.floor((budget - h1) / (h2 - h1))


def _crossing(probes, phases, budget: float, lo: int, hi: int | None) -> int:
    """Where the peak reaches ``budget``, rounded down, from ``lo`` and its nearest other
    probe (``hi``, else the one below ``lo``): each phase's peak (forward/backward, the
    optimizer step) is a line of its own, and the first to reach the budget decides; the
    peak itself, the larger of them, bends where they cross, so its own line (used when
    the phases are unknown) may overshoot. Twice ``lo`` when there is no line."""
    other = hi if hi is not None and probes.get(hi) is not None else max((v for v in probes if v < lo), default=None)
    if other is None or probes.get(other) is None:
        return 2 * lo
    lines = [(probes[lo], probes[other])]
    if phases.get(lo) and phases.get(other) and phases[lo].keys() == phases[other].keys():
        lines = [(phases[lo][k], phases[other][k]) for k in phases[lo]]
    crossings = []
    for p1, p2 in lines:
        if (p2 - p1) * (other - lo) > 0:  # rising: it reaches the budget somewhere ahead
            crossings.append(lo + (budget - p1) * (other - lo) / (p2 - p1))
    return int(min(crossings)) if crossings else 2 * lo


def find_rows(cfg: PlanConfig, world_sizes, device_type: str, progress: Progress | None = None) -> list[dict[str, Any]]:
    find = _value(cfg.plan.find)
    knob = {"batch_size": "trainer.batch_size", "depth": "model.n_layers"}[find]
    out = []
    for name in strategy_names(cfg):
        for combo in lever_combos(cfg):
            if not applies(name, combo):
                continue
            for ws in world_sizes:
                found = largest(cfg, name, ws, knob, device_type, combo=combo)
                label = f"{name}{'' if combo == 'none' else ' + ' + combo}"
                if progress is not None:
                    progress.done(1, f"{find} of {label} x{ws}: {found['value']}")
                out.append({"strategy": name, "levers": combo, "world_size": ws, "find": find, **found})
                out[-1]["probes"] = {str(k): v for k, v in found["probes"].items()}
    return out


def faked(cfg: PlanConfig) -> str:
    """What the fake steps stand for (the device and its kernels)."""
    if cfg.plan.params is not None:
        return f"{_value(cfg.plan.device)} (a raw count is analytic: nothing is faked)"
    if _value(cfg.plan.device) == "cuda":
        workspace, source = cublas_workspace_mib()
        return (f"cuda (fake tensors with the kernels CUDA chooses: fused attention, foreach optimizer; "
                f"+ {workspace:g} MiB cuBLAS workspace: {source})")  # fmt: skip
    return "cpu (the kernels a CPU run uses)"
