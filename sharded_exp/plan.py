"""Plan before you run: predicted memory per rank for every strategy and world size.

    python -m sharded_exp.plan model=gpt_7b plan.world_sizes=[8,64] plan.device_memory_gib=80
    python -m sharded_exp.plan plan.params=7.5e9 plan.format=json
    python -m sharded_exp.plan model=gpt2_xl trainer.batch_size=4 precision=bf16

Same config groups and overrides as training (its own primary config, ``conf/plan.yaml``,
adds the ``plan`` settings). The model is built on the meta device (no memory: a 7B model
plans in seconds). Model states come from the very function that makes every run's
prediction in the parent (:mod:`sharded_exp.measure.prediction`), so every run checks the
planner. Activations are estimated for the transformer from its shape, per-rank batch and
precision (``activation_bytes``).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch

from sharded_exp.compose import compose
from sharded_exp.measure.prediction import ModelShapes, activation_bytes, model_shapes, predict
from sharded_exp.models import build_model
from sharded_exp.strategies import STRATEGIES

GIB = 2**30
MIB = 2**20


def plan_rows(cfg, shapes: ModelShapes, world_sizes) -> list[dict[str, Any]]:
    precision = str(cfg.precision.name)
    act = activation_bytes(cfg.model, cfg.trainer.batch_size, precision) if cfg.plan.params is None else None
    rows = []
    for name in STRATEGIES.names():
        strategy_cfg = STRATEGIES.config_class(name)()
        for ws in world_sizes:
            prediction = predict(strategy_cfg, cfg.optimizer, precision, shapes, ws)
            states = max(prediction["model_states_mib"], key=lambda p: sum(p.values()))
            parts = {
                "params_gib": states["params"] * MIB / GIB,
                "grads_gib": states["grads"] * MIB / GIB,
                "optimizer_gib": states["optimizer"] * MIB / GIB,
                "gathered_params_gib": prediction["transient_params_mib"] * MIB / GIB,
                "activations_gib": None if act is None else act / GIB,
            }
            total = sum(v for v in parts.values() if v is not None)
            rows.append(
                {
                    "strategy": name,
                    "world_size": ws,
                    **parts,
                    "total_gib": total,
                    "fits": total <= cfg.plan.device_memory_gib,
                }  # fmt: skip
            )
    return rows


def largest_depth(cfg, max_layers: int = 512) -> dict[str, int]:
    """Deepest GPT at the configured width that each strategy fits (plan.largest_world_size).

    Analytic: a depth-L model is the 1-layer model's root plus L copies of its block
    (parameter order within groups is approximated: root first, then the blocks).
    The search stops at ``max_layers``: a strategy reported at 512 fits at least that deep.
    """
    if cfg.model.name != "gpt" or cfg.plan.params is not None:
        return {}
    one = cfg.copy()
    one.model.n_layers = 1
    with torch.device("meta"):
        module = build_model(one.model)
    in_block = {id(p) for block in module.blocks() for p in block.parameters()}
    root = [tuple(p.shape) for p in module.parameters() if id(p) not in in_block]
    block = [tuple(p.shape) for p in module.parameters() if id(p) in in_block]
    block_numel = sum(math.prod(s) for s in block)
    root_numel = sum(math.prod(s) for s in root)
    ws = cfg.plan.largest_world_size
    deeper = cfg.copy()

    def fitting(depth: int) -> set:
        shapes = root + block * depth
        groups = [[s for s in shapes if len(s) >= 2], [s for s in shapes if len(s) < 2]]
        deeper.model.n_layers = depth
        rows = plan_rows(deeper, ModelShapes(groups, [block_numel] * depth, root_numel, {}), [ws])
        return {r["strategy"] for r in rows if r["fits"]}

    out = {}
    for name in STRATEGIES.names():
        # Memory grows with depth: double until it no longer fits, then bisect.
        lo, hi = 0, 1
        while hi <= max_layers and name in fitting(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, max_layers + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if name in fitting(mid) else (lo, mid)
        out[name] = lo
    return out


def format_table(rows, depth, cfg, params) -> str:
    head = ["strategy", "world_size", "params", "grads", "optimizer", "gathered", "activations", "total", "fits"]
    lines = [
        f"model: {cfg.model.name} ({params:,} params), precision {cfg.precision.name}, optimizer {cfg.optimizer.name}, "
        f"batch {cfg.trainer.batch_size}/rank; GiB per rank; device {cfg.plan.device_memory_gib:g} GiB",
        " | ".join(head),
        " | ".join("---" for _ in head),
    ]
    for r in rows:
        cells = [r["strategy"], r["world_size"]] + [
            "-" if r[k] is None else f"{r[k]:.2f}"
            for k in ("params_gib", "grads_gib", "optimizer_gib", "gathered_params_gib", "activations_gib", "total_gib")
        ]
        lines.append(" | ".join(str(c) for c in cells + ["yes" if r["fits"] else "no"]))
    if depth:
        lines.append(
            f"\nlargest depth at d_model={cfg.model.d_model} that fits {cfg.plan.device_memory_gib:g} GiB on "
            f"{cfg.plan.largest_world_size} ranks: " + ", ".join(f"{k} {v}" for k, v in depth.items())
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = compose(argv, config_name="plan")
    if cfg.plan.params is not None:
        n = int(cfg.plan.params)
        shapes = ModelShapes([[(n,)]], [], n, {})
    else:
        shapes = model_shapes(cfg.model, cfg.optimizer)
    params = sum(math.prod(s) for g in shapes.groups for s in g)
    rows = plan_rows(cfg, shapes, list(cfg.plan.world_sizes))
    depth = largest_depth(cfg)
    if cfg.plan.format == "json":
        print(json.dumps({"params": params, "rows": rows, "largest_depth": depth}, indent=2))
    else:
        print(format_table(rows, depth, cfg, params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
