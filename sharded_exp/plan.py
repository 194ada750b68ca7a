"""Plan before you run: every rank's peak memory for each strategy and world size.

    python -m sharded_exp.plan model=gpt_7b trainer.batch_size=1 plan.world_sizes=[8,64]
    python -m sharded_exp.plan model=hf_llama plan.find=batch_size plan.device_memory_gib=0.5
    python -m sharded_exp.plan plan.params=7.5e9 plan.world_sizes=[64] precision=16
    python -m sharded_exp.plan model=gpt2_xl precision=bf16 plan.strategies=[ddp,fsdp]

Same config groups and overrides as training (its own primary config, ``conf/plan.yaml``,
adds the ``plan`` settings). For a configured model, each (strategy, world size) point is
one fake training step (:mod:`sharded_exp.measure.fake_step`): the very prediction every run
makes in its parent, so every run checks the planner. For a raw parameter count
(``plan.params``) there is no model to run: the count is an ideally divisible model
(``plan.units`` equal blocks, each split into one equal tensor per rank: the ZeRO paper's
assumption) under each strategy's analytic memory model, without activations.

``plan.find=batch_size`` adds the largest per-rank batch that fits
``plan.device_memory_gib``; ``plan.find=depth`` the deepest GPT at the configured width.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from sharded_exp.measure.prediction import ModelShapes, model_shapes, predict, predict_peak
from sharded_exp.strategies import STRATEGIES

GIB = 2**30
MIB = 2**20
PARTS = ("params", "grads", "optimizer", "gathered", "activations", "temporaries", "communication", "other")


def _value(option) -> str | None:
    return None if option is None else str(getattr(option, "value", option))


def strategy_names(cfg) -> list[str]:
    return list(cfg.plan.strategies) if cfg.plan.strategies else STRATEGIES.names()


def with_strategy(cfg, name: str):
    out = cfg.copy()
    out.strategy = STRATEGIES.config_class(name)()
    return out


def raw_shapes(params: int, units: int, world_size: int) -> ModelShapes:
    """``params`` as an ideally divisible model: ``units`` equal blocks of ``world_size``
    equal 1-D tensors (every rank's shard, owner and bucket share come out equal)."""
    pieces = units * world_size
    size = math.ceil(params / pieces)
    return ModelShapes([[(size,)] * pieces], [size * world_size] * units, 0, {})


def raw_row(cfg, name: str, world_size: int) -> dict[str, Any]:
    params, units = int(cfg.plan.params), int(cfg.plan.units)
    cfg_s = with_strategy(cfg, name)
    shapes = raw_shapes(params, units, world_size)
    prediction = predict(cfg_s.strategy, cfg.optimizer, str(cfg.precision.name), shapes, world_size)
    states = max(prediction["model_states_mib"], key=lambda p: sum(p.values()))
    parts = {k: 0.0 for k in PARTS} | {k: states[k] * MIB / GIB for k in ("params", "grads", "optimizer")}
    parts["gathered"] = prediction["transient_params_mib"] * MIB / GIB
    parts["activations"] = None
    return _row(cfg, name, world_size, parts, "raw parameter count (analytic, no activations)", "")


def model_row(cfg, name: str, world_size: int, shapes: ModelShapes, device_type: str) -> dict[str, Any]:
    cfg_s = with_strategy(cfg, name)
    prediction = predict(cfg_s.strategy, cfg.optimizer, str(cfg.precision.name), shapes, world_size)
    peak = predict_peak(cfg_s, world_size, device_type, prediction, shapes, flops=False)
    states = max(sum(p.values()) for p in prediction["model_states_mib"])
    if peak["per_rank_mib"] is None:
        parts = {k: None for k in PARTS}
        row = _row(cfg, name, world_size, parts, "none", peak["error"])
        row["total_gib"], row["fits"] = None, None
    else:
        parts = {k: v * MIB / GIB for k, v in peak["breakdown_mib"].items()}
        row = _row(cfg, name, world_size, parts, peak["method"], peak["note"])
        row["total_gib"] = max(peak["per_rank_mib"]) * MIB / GIB  # the peak itself
        row["fits"] = row["total_gib"] <= cfg.plan.device_memory_gib
        row["seconds"] = peak["seconds"]
    row["model_states_gib"] = states * MIB / GIB  # analytic: what every run predicts and checks
    return row


def _row(cfg, name, world_size, parts, method, note) -> dict[str, Any]:
    total = sum(v for v in parts.values() if v is not None)
    return {
        "strategy": name,
        "world_size": world_size,
        **{f"{k}_gib": v for k, v in parts.items()},
        "total_gib": total,
        "fits": total <= cfg.plan.device_memory_gib,
        "method": method,
        "note": note,
    }


def plan_rows(cfg, world_sizes, device_type: str = "cpu") -> list[dict[str, Any]]:
    shapes = None if cfg.plan.params is not None else model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    rows = []
    for name in strategy_names(cfg):
        for ws in world_sizes:
            if shapes is None:
                rows.append(raw_row(cfg, name, ws))
            else:
                rows.append(model_row(cfg, name, ws, shapes, device_type))
    return rows


def _peak_gib(cfg, world_size: int, device_type: str, errors: list[str]) -> float | None:
    """The largest rank's predicted peak in GiB, or None (why is appended to ``errors``)."""
    shapes = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
    prediction = predict(cfg.strategy, cfg.optimizer, str(cfg.precision.name), shapes, world_size)
    peak = predict_peak(cfg, world_size, device_type, prediction, shapes, flops=False)
    if peak["per_rank_mib"] is None:
        errors.append(peak["error"])
        return None
    return max(peak["per_rank_mib"]) * MIB / GIB


def largest(cfg, name: str, world_size: int, knob: str, device_type: str, limit: int = 1 << 20) -> dict[str, Any]:
    """The largest value of ``knob`` (``trainer.batch_size`` or ``model.n_layers``) at which
    ``name`` fits ``plan.device_memory_gib`` on ``world_size`` ranks.

    The peak grows linearly in either (activations per sample; states and activations per
    layer): fake steps at 1 and 2 give the line, and the value it predicts is then checked
    by fake steps at the answer (must fit) and one above (must not), moving down or up
    until both hold.
    """
    budget = cfg.plan.device_memory_gib
    section, key = knob.split(".")
    probes: dict[int, float | None] = {}
    errors: list[str] = []

    def peak(value: int) -> float | None:
        if value not in probes:
            c = with_strategy(cfg, name)
            c[section][key] = value
            probes[value] = _peak_gib(c, world_size, device_type, errors)
        return probes[value]

    one, two = peak(1), peak(2)
    if one is None or two is None:
        return {"value": None, "probes": probes, "note": f"no fake step: {errors[0]}"}
    if one > budget:
        return {"value": 0, "probes": probes, "note": f"{knob}=1 does not fit"}
    slope = max(two - one, 1e-12)
    guess = max(1, min(limit, int((budget - one) / slope) + 1))
    while guess > 1 and (peak(guess) is None or peak(guess) > budget):
        guess -= 1
    while guess < limit and peak(guess + 1) is not None and peak(guess + 1) <= budget:
        guess += 1
    return {"value": guess, "probes": probes, "note": f"checked by fake steps at {guess} and {guess + 1}"}


def find_rows(cfg, world_sizes, device_type: str) -> list[dict[str, Any]]:
    find = _value(cfg.plan.find)
    knob = {"batch_size": "trainer.batch_size", "depth": "model.n_layers"}[find]
    out = []
    for name in strategy_names(cfg):
        for ws in world_sizes:
            found = largest(cfg, name, ws, knob, device_type)
            out.append({"strategy": name, "world_size": ws, "find": find, **found})
            out[-1]["probes"] = {str(k): v for k, v in found["probes"].items()}
    return out


def format_table(rows, found, cfg, params) -> str:
    head = ["strategy", "world_size", *PARTS, "peak", "fits", "method"]
    what = "raw parameter count" if cfg.plan.params is not None else f"model: {cfg.model.name}"
    big = max((r["total_gib"] or 0 for r in rows), default=0) >= 1
    unit, scale = ("GiB", 1) if big else ("MiB", GIB / MIB)
    lines = [
        f"{what} ({params:,} params), precision {cfg.precision.name}, optimizer {cfg.optimizer.name}, "
        f"batch {cfg.trainer.batch_size}/rank; {unit} per rank at the peak; device {cfg.plan.device_memory_gib:g} GiB",
        " | ".join(head),
        " | ".join("---" for _ in head),
    ]
    for r in rows:
        cells = [r["strategy"], r["world_size"]] + [
            "-" if r[f"{k}_gib"] is None else f"{r[f'{k}_gib'] * scale:.2f}" for k in (*PARTS, "total")
        ]
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        lines.append(" | ".join(str(c) for c in cells + [fits, r["method"]]))
    notes = sorted({f"{r['strategy']}: {r['note']}" for r in rows if r["note"]})
    lines += [f"note: {n}" for n in notes]
    if found:
        label = {
            "batch_size": "largest batch per rank",
            "depth": f"largest depth at d_model={cfg.model.get('d_model')}",
        }
        lines.append(f"\n{label[_value(cfg.plan.find)]} that fits {cfg.plan.device_memory_gib:g} GiB:")
        lines += [f"  {f['strategy']} x{f['world_size']}: {f['value']} ({f['note']})" for f in found]
    return "\n".join(lines)


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
    if _value(p.find) == "depth" and (p.params is not None or "n_layers" not in cfg.model):
        raise ConfigError("plan.find=depth needs a model with model.n_layers (e.g. model=gpt), not a raw count")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(argv, config_name="plan")
        check_plan(cfg, argv)
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.plan.params is not None:
        params = int(cfg.plan.params)
    else:
        shapes = model_shapes(cfg.model, cfg.optimizer, freeze=cfg.trainer.freeze)
        params = sum(math.prod(s) for g in shapes.groups for s in g)
    world_sizes = list(cfg.plan.world_sizes)
    rows = plan_rows(cfg, world_sizes, device_type)
    found = find_rows(cfg, world_sizes, device_type) if cfg.plan.find else []
    if _value(cfg.plan.format) == "json":
        print(json.dumps({"params": params, "device": device_type, "rows": rows, "found": found}, indent=2))
    else:
        print(format_table(rows, found, cfg, params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
