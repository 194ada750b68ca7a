"""Plan before you run: every rank's peak memory for each strategy and world size.

    python -m sharded_exp.plan model=gpt_7b trainer.batch_size=1 plan.world_sizes=[8,64]
    python -m sharded_exp.plan model=hf_llama plan.find=batch_size plan.device_memory_gib=0.5
    python -m sharded_exp.plan plan.params=7.5e9 plan.world_sizes=[64] precision=16
    python -m sharded_exp.plan model=gpt2_xl precision=bf16 plan.strategies=[ddp,fsdp]
    python -m sharded_exp.plan model=gpt_7b trainer.batch_size=1 plan.world_sizes=[1,8,64] plan.plot=plan.png

Same config groups and overrides as training (its own primary config, ``conf/plan.yaml``,
adds the ``plan`` settings). For a configured model, each (strategy, world size) point is
one fake training step (:mod:`sharded_exp.measure.fake_step`): the very prediction every run
makes in its parent, so every run checks the planner. For a raw parameter count
(``plan.params``) there is no model to run: the count is an ideally divisible model
(``plan.units`` equal blocks, each split into one equal tensor per rank: the ZeRO paper's
assumption) under each strategy's analytic memory model, without activations.

``plan.find=batch_size`` adds the largest per-rank batch that fits
``plan.device_memory_gib``; ``plan.find=depth`` the deepest GPT at the configured width.
``plan.plot=plan.png`` also draws the plan (peak per rank vs world size per strategy,
the device memory as a line).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from sharded_exp.measure.prediction import ModelShapes, model_shapes, peaks_of_ranks, predict, predict_peak
from sharded_exp.models.target import check_pretrained, is_target_model
from sharded_exp.strategies import STRATEGIES

GIB = 2**30
MIB = 2**20
PARTS = (
    "params",
    "grads",
    "optimizer",
    "gathered",
    "buckets",
    "activations",
    "temporaries",
    "communication",
    "other",
    "workspace",
)


def _value(option) -> str | None:
    return None if option is None else str(getattr(option, "value", option))


def strategy_names(cfg) -> list[str]:
    return list(cfg.plan.strategies) if cfg.plan.strategies else STRATEGIES.names()


LEVERS = {"ac": ("activation_checkpointing", "full"), "ac_selective": ("activation_checkpointing", "selective"),
          "offload": ("cpu_offload", True)}  # fmt: skip
"""The planner's lever names (``plan.levers`` entries join them with +) and what each sets."""
LEVER_COST = {"none": 0, "ac_selective": 1, "ac": 2, "offload": 3}
"""Extra recompute or traffic each lever costs, in the order a user would reach for them."""
STRATEGY_COST = {"ddp": 0, "zero1": 1, "oss": 1, "sharded_ddp": 2, "fsdp_grad_op": 3, "fsdp": 4}
"""Extra communication per strategy: DDP < ZeRO-1 < ZeRO-2 < FSDP."""


def lever_names(combo: str) -> list[str]:
    return [] if combo == "none" else combo.split("+")


def applies(name: str, combo: str) -> bool:
    """Offload is FSDP's (fsdp, fsdp_grad_op); the others apply to every strategy."""
    return "offload" not in lever_names(combo) or STRATEGIES.builder(name).shards_parameters


def with_strategy(cfg, name: str, combo: str = "none"):
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


def raw_shapes(params: int, units: int, world_size: int, row_sharded: bool = False) -> ModelShapes:
    """``params`` as an ideally divisible model: ``units`` equal blocks of ``world_size``
    equal 1-D tensors (every rank's owner share and bucket share come out equal), or, for
    a strategy that shards every tensor by rows (``row_sharded``: FSDP), one tensor of
    ``world_size`` rows per block (every rank's row shard comes out equal)."""
    if row_sharded:
        cols = math.ceil(params / (units * world_size))
        return ModelShapes([[(world_size, cols)] * units], [world_size * cols] * units, 0, {})
    pieces = units * world_size
    size = math.ceil(params / pieces)
    return ModelShapes([[(size,)] * pieces], [size * world_size] * units, 0, {})


def _raw_parts(cfg, name: str, world_size: int) -> dict[str, float]:
    """Rank 0's model states (GiB) for ``plan.params`` as an ideally divisible model."""
    cfg_s = with_strategy(cfg, name)
    row_sharded = STRATEGIES.builder(name).shards_parameters
    shapes = raw_shapes(int(cfg.plan.params), int(cfg.plan.units), world_size, row_sharded)
    # Every rank holds the same by construction: rank 0 stands for all.
    prediction = predict(cfg_s.strategy, cfg.optimizer, str(cfg.precision.name), shapes, world_size, ranks=[0])
    states = prediction["model_states_mib"][0]
    parts = {k: states[k] * MIB / GIB for k in ("params", "grads", "optimizer")}
    # The strategy's communication buckets, as a model plan's fake step files them: beside
    # the gradients, or holding them (ShardedDDP's; DDP's with gradient_as_bucket_view).
    strategy = STRATEGIES.builder(name)
    numels = [math.prod(s) for g in shapes.groups for s in g]
    owners = strategy.partition([[math.prod(s) for s in g] for g in shapes.groups], world_size)
    held, aliased = strategy.bucket_numel(cfg_s.strategy, numels, owners, 0, world_size)
    parts["grads"] -= aliased * shapes.element_bytes / GIB
    parts["buckets"] = held * shapes.element_bytes / GIB
    return parts | {"gathered": prediction["transient_params_mib"] * MIB / GIB}


EXACT_UP_TO = 1024
"""World sizes up to this are planned tensor by tensor; beyond it, from the line below."""


def _raw_parts_at_scale(cfg, name: str, world_size: int) -> tuple[dict[str, float], str]:
    """Each figure of an ideally divisible model is held whole or split evenly, so it is
    a + b / world_size: two exact plans (256 and 512 ranks) give the line, a third (1024)
    checks it, and the line answers for any world size in milliseconds. Where the check
    fails (a strategy whose buckets change regime), the exact plan is made."""
    w1, w2, w3 = EXACT_UP_TO // 4, EXACT_UP_TO // 2, EXACT_UP_TO
    p1, p2, p3 = (_raw_parts(cfg, name, w) for w in (w1, w2, w3))
    line = {}
    for k in p1:
        b = (p1[k] - p2[k]) / (1 / w1 - 1 / w2)
        a = p1[k] - b / w1
        if not math.isclose(a + b / w3, p3[k], rel_tol=1e-4, abs_tol=1e-9):  # rounding of the pieces: ~1e-5
            return _raw_parts(cfg, name, world_size), ""
        line[k] = max(0.0, a + b / world_size)
    return line, f"from the exact plans at {w1}, {w2} and {w3} ranks (every figure is a + b/world_size)"


def raw_row(cfg, name: str, world_size: int) -> dict[str, Any]:
    if world_size <= EXACT_UP_TO:
        states, note = _raw_parts(cfg, name, world_size), ""
    else:
        states, note = _raw_parts_at_scale(cfg, name, world_size)
    parts = {k: 0.0 for k in PARTS} | states | {"activations": None}
    return _row(cfg, name, world_size, parts, "raw parameter count (analytic, no activations)", note)


LAYER_KEYS = ("n_layers", "config.num_hidden_layers", "config.n_layer")
"""Where a model keeps its number of identical blocks (ours; Hugging Face's configs)."""
FAKED_LAYERS = (3, 4, 5)
"""A deeper model's peak is faked at these depths and drawn to its own (see :func:`_peak_by_depth`);
not 2: under FSDP a 2-block model's forward peak lies off the line the deeper ones follow."""


def _layer_key(model_cfg) -> str | None:
    for key in LAYER_KEYS:
        if isinstance(OmegaConf.select(model_cfg, key, default=None), int):
            return key
    return None


def _peak_by_depth(cfg_s, world_size: int, device_type: str, prediction: dict[str, Any], key: str, layers: int):
    """The fake step's cost grows with the model's ops; each phase's peak (forward and
    backward; the optimizer step) grows linearly with depth (each block adds its states,
    activations and temporaries; the logits and the gathered unit do not grow). So a deep
    model is faked at 3, 4 and 5 blocks: in every phase the steps from 3 to 4 and 4 to 5
    must agree (each part within 0.1%, optimizer state aside), each phase's line is drawn to
    ``layers`` blocks, and the larger is the peak. None when a phase bends (the whole
    model is faked then)."""
    peaks = []
    for n in FAKED_LAYERS:
        c = cfg_s.copy()
        OmegaConf.update(c.model, key, n)
        shapes_n = model_shapes(c.model, c.optimizer, freeze=c.trainer.freeze)
        prediction_n = predict(c.strategy, c.optimizer, str(c.precision.name), shapes_n, world_size)
        peak = predict_peak(c, world_size, device_type, prediction_n, shapes_n, flops=False)
        if peak["per_rank_mib"] is None:
            return peak
        peak["state_optimizer_mib"] = prediction_n["model_states_mib"][peak["rank"]]["optimizer"]
        peaks.append(peak)
    steps = layers - FAKED_LAYERS[-1]
    # The optimizer state a rank holds is lumpy in depth where whole tensors are dealt out
    # (OSS, ZeRO-1: which rank holds most changes with the count): it is taken at full
    # depth from the analytic model states, and only what the step adds to it (its
    # temporaries), like everything else, is drawn along its line.
    optimizer = max(prediction["model_states_mib"], key=lambda p: sum(p.values()))["optimizer"]
    drawn = {}
    for phase in peaks[-1]["phases_mib"]:
        if not all(phase in p["phases_mib"] for p in peaks):
            return None
        pa, pb, pc = ({**p["phases_mib"][phase][1]} for p in peaks)
        for p, peak in zip((pa, pb, pc), peaks):
            p["optimizer"] -= peak["state_optimizer_mib"]
        for k in pc:  # each part on its line (ShardedDDP's bucketed gradients are not)
            if abs((pc[k] - pb[k]) - (pb[k] - pa[k])) > 1e-3 * abs(pc[k]) + 1e-3:
                return None
        parts = {k: pc[k] + steps * (pc[k] - pb[k]) for k in pc}
        parts["optimizer"] += optimizer
        drawn[phase] = (sum(parts.values()), parts)
    top, parts = max(drawn.values(), key=lambda d: d[0])
    states = prediction["model_states_mib"]
    rank = max(range(len(states)), key=lambda r: sum(states[r].values()))
    return {
        "per_rank_mib": peaks_of_ranks(list(drawn.values()), states, rank),  # the largest is ``top``
        "breakdown_mib": parts,
        "phases_mib": drawn,
        "method": f"fake steps at {', '.join(map(str, FAKED_LAYERS))} blocks, drawn to the model's depth",
        "note": f"{key}={layers}: faked at {', '.join(map(str, FAKED_LAYERS))} blocks (each phase's peak is linear "
        "in depth)",
        "seconds": sum(p["seconds"] or 0 for p in peaks),
    }


def model_row(cfg, name: str, world_size: int, shapes: ModelShapes, device_type: str, combo: str = "none"):
    cfg_s = with_strategy(cfg, name, combo)
    prediction = predict(cfg_s.strategy, cfg.optimizer, str(cfg.precision.name), shapes, world_size)
    key = _layer_key(cfg.model)
    layers = OmegaConf.select(cfg.model, key) if key else 0
    peak = None
    if layers > FAKED_LAYERS[-1] and cfg.plan.by_depth and STRATEGIES.builder(name).grads_linear_in_depth:
        peak = _peak_by_depth(cfg_s, world_size, device_type, prediction, key, layers)
    if peak is None:
        peak = predict_peak(cfg_s, world_size, device_type, prediction, shapes, flops=False)
    states = max(sum(p.values()) for p in prediction["model_states_mib"])
    if peak["per_rank_mib"] is None:
        parts = {k: None for k in PARTS}
        row = _row(cfg, name, world_size, parts, "none", peak["error"])
        row["total_gib"], row["mean_gib"], row["fits"] = None, None, None
    else:
        parts = {k: v * MIB / GIB for k, v in peak["breakdown_mib"].items()}
        row = _row(cfg, name, world_size, parts, peak["method"], peak["note"])
        row["total_gib"] = max(peak["per_rank_mib"]) * MIB / GIB  # the peak itself
        # the average over ranks (the seed study's figure): below the peak where shards are uneven
        row["mean_gib"] = sum(peak["per_rank_mib"]) / len(peak["per_rank_mib"]) * MIB / GIB
        if "offload" in lever_names(combo):  # CPU offload: the rank's states are in host memory
            row["host_gib"] = states * MIB / GIB
        row["fits"] = row["total_gib"] <= cfg.plan.device_memory_gib
        row["seconds"] = peak["seconds"]
        # each phase's peak (forward/backward "step", "optimizer"): plan.find follows them
        row["phases_gib"] = {name: v[0] * MIB / GIB for name, v in (peak.get("phases_mib") or {}).items()}
    row["model_states_gib"] = states * MIB / GIB  # analytic: what every run predicts and checks
    row["levers"] = combo
    row["cost"] = _cost_note(combo, prediction)
    return row


def _cost_note(combo: str, prediction) -> str:
    """What a lever costs in step time, where it is known without running."""
    notes = []
    levers = lever_names(combo)
    if "ac" in levers:
        notes.append("recompute: one more forward of every unit (about +1/3 of the step's FLOPs)")
    if "ac_selective" in levers:
        notes.append("recompute: the units' cheap ops (norms, activations) again in the backward")
    if "offload" in levers:
        mine = max(prediction["model_states_mib"], key=lambda p: sum(p.values()))
        moved = (mine["params"] + mine["grads"]) * MIB / GIB
        notes.append(f"offload: {moved:.2f} GiB host<->device per step (sharded parameters in, gradients out)")
    return "; ".join(notes)


def _row(cfg, name, world_size, parts, method, note) -> dict[str, Any]:
    total = sum(v for v in parts.values() if v is not None)
    return {
        "strategy": name,
        "world_size": world_size,
        **{f"{k}_gib": v for k, v in parts.items()},
        "total_gib": total,
        "mean_gib": total,  # every rank alike (a raw count's ideally divisible model); a model's row sets its own
        "fits": total <= cfg.plan.device_memory_gib,
        "method": method,
        "note": note,
    }


def lever_combos(cfg) -> list[str]:
    return [str(c) for c in cfg.plan.get("levers", None) or ["none"]]


def plan_rows(cfg, world_sizes, device_type: str = "cpu") -> list[dict[str, Any]]:
    shapes = None if cfg.plan.params is not None else model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    rows = []
    for name in strategy_names(cfg):
        for combo in lever_combos(cfg) if shapes is not None else ["none"]:
            if not applies(name, combo):
                continue
            for ws in world_sizes:
                started = time.perf_counter()
                if shapes is None:
                    rows.append(raw_row(cfg, name, ws))
                else:
                    rows.append(model_row(cfg, name, ws, shapes, device_type, combo))
                    progress(f"{name}{'' if combo == 'none' else ' + ' + combo} x{ws}: {rows[-1]['method']}", started)
    return rows


def cheapest(rows) -> list[dict[str, Any]]:
    """Per world size, the planned point that fits with the least extra communication and
    recompute: strategies DDP < ZeRO-1 < ZeRO-2 < FSDP, then levers none < selective AC <
    AC < offload (a lever costs more than any strategy)."""
    out = []
    for ws in sorted({r["world_size"] for r in rows}):
        fitting = [r for r in rows if r["world_size"] == ws and r.get("fits")]
        if fitting:
            key = lambda r: (sum(LEVER_COST[x] for x in lever_names(r.get("levers", "none"))),  # noqa: E731
                             STRATEGY_COST.get(r["strategy"], 9), r["total_gib"])  # fmt: skip
            out.append(min(fitting, key=key))
    return out


def progress(what: str, started: float) -> None:
    """A line per planned point on stderr: a long plan shows that it moves."""
    print(f"plan: {what} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)


def _peak_gib(cfg, world_size: int, device_type: str, errors: list[str], combo: str = "none"):
    """The largest rank's predicted peak in GiB, or None (why is appended to ``errors``),
    and the faked rank's peak in each phase."""
    shapes = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    row = model_row(cfg, cfg.strategy.name, world_size, shapes, device_type, combo)  # drawn by depth where it can be
    if row["total_gib"] is None:
        errors.append(row["note"])
    return row["total_gib"], row.get("phases_gib") or {}


def largest(
    cfg, name: str, world_size: int, knob: str, device_type: str, limit: int = 1 << 20, combo: str = "none"
) -> dict[str, Any]:
    """The largest value of ``knob`` (``trainer.batch_size`` or ``model.n_layers``) at which
    ``name`` fits ``plan.device_memory_gib`` on ``world_size`` ranks.

    The peak grows about linearly in either (activations per sample; states and
    activations per layer): fake steps at 1 and 2 give a line, and each next fake step is
    where the line through the two probes nearest the budget crosses it (regula falsi,
    integer-rounded), until the answer fits and one above does not. Four fake steps when
    the peak is linear; a few more when it bends.
    """
    budget = cfg.plan.device_memory_gib
    section, key = knob.split(".")
    probes: dict[int, float | None] = {}
    phases: dict[int, dict[str, float]] = {}
    errors: list[str] = []

    def peak(value: int) -> float | None:
        if value not in probes:
            c = with_strategy(cfg, name)
            c[section][key] = value
            probes[value], phases[value] = _peak_gib(c, world_size, device_type, errors, combo)
        return probes[value]

    one, two = peak(1), peak(2)
    if one is None or two is None:
        return {"value": None, "probes": probes, "note": f"no fake step: {errors[0]}"}
    if one > budget:
        return {"value": 0, "probes": probes, "note": f"{knob}=1 does not fit"}
    lo, hi = (2, None) if two <= budget else (1, 2)  # largest known to fit, smallest known not to
    while (hi is None or hi > lo + 1) and lo < limit:
        guess = _crossing(probes, phases, budget, lo, hi)
        guess = min(max(guess, lo + 1), hi - 1 if hi is not None else limit)
        p = peak(guess)
        lo, hi = (guess, hi) if p is not None and p <= budget else (lo, guess)
    note = f"checked by fake steps at {lo} and {hi}" if hi is not None else f"fits up to the limit {limit}"
    return {"value": lo, "probes": probes, "note": note}


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


def find_rows(cfg, world_sizes, device_type: str) -> list[dict[str, Any]]:
    find = _value(cfg.plan.find)
    knob = {"batch_size": "trainer.batch_size", "depth": "model.n_layers"}[find]
    out = []
    for name in strategy_names(cfg):
        for combo in lever_combos(cfg):
            if not applies(name, combo):
                continue
            for ws in world_sizes:
                started = time.perf_counter()
                found = largest(cfg, name, ws, knob, device_type, combo=combo)
                label = f"{name}{'' if combo == 'none' else ' + ' + combo}"
                progress(f"{find} of {label} x{ws}: {found['value']}, {len(found['probes'])} fake steps", started)
                out.append({"strategy": name, "levers": combo, "world_size": ws, "find": find, **found})
                out[-1]["probes"] = {str(k): v for k, v in found["probes"].items()}
    return out


def format_table(rows, found, cfg, params) -> str:
    head = ["strategy", "levers", "world_size", *PARTS, "peak", "mean", "host", "fits", "method"]
    what = "raw parameter count" if cfg.plan.params is not None else f"model: {cfg.model.name}"
    big = max((r["total_gib"] or 0 for r in rows), default=0) >= 1
    unit, scale = ("GiB", 1) if big else ("MiB", GIB / MIB)
    lines = [
        f"{what} ({params:,} params), precision {cfg.precision.name}, optimizer {cfg.optimizer.name}, "
        f"batch {cfg.trainer.batch_size}/rank; {unit} per rank at the peak (peak: the largest rank's, mean: the "
        f"average over ranks); device {cfg.plan.device_memory_gib:g} GiB",
        f"device faked: {_faked(cfg)}",
        " | ".join(head),
        " | ".join("---" for _ in head),
    ]
    for r in rows:
        cells = [r["strategy"], r.get("levers", "none"), r["world_size"]] + [
            "-" if r[f"{k}_gib"] is None else f"{r[f'{k}_gib'] * scale:.2f}" for k in (*PARTS, "total", "mean")
        ]
        host = f"{r['host_gib'] * scale:.2f}" if r.get("host_gib") is not None else "-"
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        lines.append(" | ".join(str(c) for c in cells + [host, fits, r["method"]]))
    notes = sorted({f"{r['strategy']}: {r['note']}" for r in rows if r["note"]})
    lines += [f"note: {n}" for n in notes]
    if len(lever_combos(cfg)) > 1 or any(r.get("levers", "none") != "none" for r in rows):
        for best in cheapest(rows):
            label = best["strategy"] + ("" if best["levers"] == "none" else f" + {best['levers']}")
            cost = f"; {best['cost']}" if best.get("cost") else ""
            lines.append(f"cheapest that fits at {best['world_size']} ranks: {label} ({best['total_gib'] * scale:.2f} "
                         f"{unit}{cost})")  # fmt: skip
    if found:
        label = {
            "batch_size": "largest batch per rank",
            "depth": f"largest depth at d_model={cfg.model.get('d_model')}",
        }
        lines.append(f"\n{label[_value(cfg.plan.find)]} that fits {cfg.plan.device_memory_gib:g} GiB:")
        lines += [f"  {f['strategy']}{'' if f.get('levers', 'none') == 'none' else ' + ' + f['levers']} "
                  f"x{f['world_size']}: {f['value']} ({f['note']})" for f in found]  # fmt: skip
    return "\n".join(lines)


def _faked(cfg) -> str:
    if cfg.plan.params is not None:
        return f"{_value(cfg.plan.device)} (a raw count is analytic: nothing is faked)"
    if _value(cfg.plan.device) == "cuda":
        from sharded_exp.measure.cuda_kernels import cublas_workspace_mib

        workspace, source = cublas_workspace_mib()
        return (f"cuda (fake tensors with the kernels CUDA chooses: fused attention, foreach optimizer; "
                f"+ {workspace:g} MiB cuBLAS workspace: {source})")  # fmt: skip
    return "cpu (the kernels a CPU run uses)"


def check_plan(cfg, argv: list[str] = ()) -> None:
    """The planner's inputs, by the training entry point's rules (ConfigError names them).
    ``argv``: the command line, to tell a model the user chose from the default one."""
    from sharded_exp.preflight import check_values

    check_values(cfg)  # strategy, model, precision, optimizer, trainer values
    p = cfg.plan
    if p.params is not None and not (math.isfinite(p.params) and p.params >= 1):
        raise ConfigError(f"plan.params={p.params} must be a finite number >= 1 (a parameter count, e.g. 7.5e9)")
    chosen = [a for a in argv if a.lstrip("+").startswith(("model=", "model."))]
    if p.params is not None and chosen:
        raise ConfigError(
            f"plan.params={p.params:g} plans a raw parameter count, and {' '.join(chosen)} would be ignored: give "
            "plan.params (with plan.units) or a model, not both"
        )
    if not p.world_sizes or any(ws < 1 for ws in p.world_sizes):
        raise ConfigError(f"plan.world_sizes={list(p.world_sizes)} must be a non-empty list of integers >= 1")
    if not (math.isfinite(p.device_memory_gib) and p.device_memory_gib > 0):
        raise ConfigError(f"plan.device_memory_gib={p.device_memory_gib} must be a finite number > 0")
    if p.units < 1:
        raise ConfigError(f"plan.units={p.units} must be >= 1")
    for name in p.strategies or []:
        STRATEGIES.builder(name)  # raises, naming the registered ones
    for combo in p.get("levers", None) or []:
        bad = [x for x in lever_names(str(combo)) if x not in LEVERS]
        if bad or not str(combo):
            raise ConfigError(
                f"plan.levers entry {combo!r}: {', '.join(bad) or 'empty'} is not a lever; levers: none, or "
                f"{', '.join(LEVERS)} joined with + (e.g. ac+offload)"
            )
    if p.plot and (not str(p.plot).lower().endswith((".png", ".svg", ".pdf")) or os.path.isdir(p.plot)):
        raise ConfigError(f"plan.plot={p.plot} must name a .png, .svg or .pdf file to draw the plan into")
    if _value(p.find) == "depth" and (p.params is not None or "n_layers" not in cfg.model):
        raise ConfigError("plan.find=depth needs a model with model.n_layers (e.g. model=gpt), not a raw count")


def usage() -> str:
    """``--help``: this module's docstring and every ``plan.*`` setting with its default."""
    from dataclasses import MISSING, fields

    from sharded_exp.config import PlanSettings

    lines = []
    for f in fields(PlanSettings):
        default = f.default_factory() if f.default is MISSING else f.default
        lines.append(f"  plan.{f.name}={getattr(default, 'value', default)}")
    return "\n".join(
        ["usage: sharded-exp-plan (python -m sharded_exp.plan) [group=option ...] [key=value ...]", __doc__,
         "plan settings (defaults):", *lines,
         "The training groups (model, precision, optimizer, trainer, ...) as in sharded-exp --help."]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(argv, config_name="plan")
        check_plan(cfg, argv)
        if is_target_model(cfg.model):
            check_pretrained(cfg.model)  # its config.json is the architecture planned for
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device_type = _value(cfg.plan.device)
    if cfg.plan.params is not None:
        params = int(cfg.plan.params)
    else:
        shapes = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
        params = sum(math.prod(s) for g in shapes.groups for s in g)
    world_sizes = list(cfg.plan.world_sizes)
    rows = plan_rows(cfg, world_sizes, device_type)
    found = find_rows(cfg, world_sizes, device_type) if cfg.plan.find else []
    if _value(cfg.plan.format) == "json":
        out = {"params": params, "device": device_type, "device_faked": _faked(cfg), "rows": rows, "found": found,
               "cheapest": [{k: r[k] for k in ("strategy", "levers", "world_size", "total_gib")} for r in cheapest(rows)]
               if cfg.plan.params is None else []}  # fmt: skip
        print(json.dumps(out, indent=2))
    else:
        print(format_table(rows, found, cfg, params))
    if cfg.plan.plot:
        try:
            print(f"plan: chart {write_chart(rows, cfg, params)}", file=sys.stderr)
        except OSError as exc:
            print(f"error: plan.plot={cfg.plan.plot} not written: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


def write_chart(rows, cfg, params: int) -> str:
    """``plan.plot``: the plan drawn (:func:`sharded_exp.output.charts.plan_chart`)."""
    from pathlib import Path

    from sharded_exp.output import charts

    count = f"{params / 1e9:.3g} B" if params >= 1e8 else f"{params:,}"
    what = (f"raw parameter count ({count} params, no activations)" if cfg.plan.params is not None
            else f"model={cfg.model.name} ({count} params), batch {cfg.trainer.batch_size}/rank")  # fmt: skip
    title = f"Planned peak per rank: {what}, precision {cfg.precision.name}, {cfg.optimizer.name}, {_value(cfg.plan.device)}"
    cost = lambda r: sum(LEVER_COST[x] for x in lever_names(r.get("levers", "none")))  # noqa: E731
    order = sorted(rows, key=lambda r: (cost(r), STRATEGY_COST.get(r["strategy"], 9)))  # the legend: cheapest first
    path = Path(cfg.plan.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    charts.save(charts.plan_chart(order, cfg.plan.device_memory_gib, title), path)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
