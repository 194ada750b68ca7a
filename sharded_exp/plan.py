"""Plan before you run: predicted memory per rank for every strategy and world size.

    python -m sharded_exp.plan model=gpt_7b plan.world_sizes=[8,64] plan.device_memory_gib=80
    python -m sharded_exp.plan plan.params=7.5e9 plan.format=json
    python -m sharded_exp.plan model=gpt2_xl trainer.batch_size=4 precision=bf16

Same config tree and overrides as training. The model is built on the meta device (no
memory: a 7B model plans in seconds). Model states come from the very model that fills the
``predicted_*`` columns of every real run (``memory_model`` + each strategy's
``resident_numel``), so every run checks the planner. Activations are estimated for the
transformer from its shape, per-rank batch and precision (``activation_bytes``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from sharded_exp.config import CONF_DIR, quote_numeric_choices, register_schemas
from sharded_exp.memory_model import predict_model_states_mib
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.strategies import STRATEGIES

GIB = 2**30
MIB = 2**20


def activation_bytes(model_cfg, batch_size: int, precision: str) -> int | None:
    """Peak activation bytes per rank of one forward + backward (no checkpointing).

    GPT, per block, about 16 values per (sample, token, channel) stay saved for backward
    (LayerNorm inputs/outputs, q/k/v, attention output and its copy, the two residual
    streams, 4x-wide MLP input of GELU and its output), plus 2 for the embeddings and final
    norm, plus 4 per (sample, token, vocabulary entry) for logits, log-softmax and their
    gradients. Fitted on CPU with torch's MemTracker and checked in tests (within 20%).
    """
    if model_cfg.name != "gpt":
        return None
    half = precision in ("16", "bf16")
    b, s, d, v = batch_size, model_cfg.seq_len, model_cfg.d_model, model_cfg.vocab_size
    per_value = 2 if half else 4
    # the loss is computed from fp32 logits (logits.float()) at every precision
    vocab_bytes = (2 + 3 * 4) if half else 4 * 4
    return per_value * b * s * d * (16 * model_cfg.n_layers + 2) + vocab_bytes * b * s * v


def model_shapes(cfg) -> tuple[list[list[tuple]], list[int], int]:
    """Parameter shapes per optimizer group, block sizes and root size, from the meta device."""
    with torch.device("meta"):
        module = build_model(cfg.model)
    groups = [[tuple(p.shape) for p in g["params"]] for g in optimizer_spec(cfg.optimizer, module).param_groups]
    blocks = [sum(p.numel() for p in block.parameters()) for block in module.blocks()]
    return groups, blocks, sum(p.numel() for p in module.parameters()) - sum(blocks)


def plan_rows(cfg, groups, blocks, root, world_sizes) -> list[dict[str, Any]]:
    act = activation_bytes(cfg.model, cfg.trainer.batch_size, cfg.precision.name) if cfg.plan.params is None else None
    param_bytes = 2 if cfg.precision.name in ("16", "bf16") else 4
    rows = []
    for name in STRATEGIES.names():
        cls = STRATEGIES.config_class(name)
        strategy_cfg = cls()
        for ws in world_sizes:
            states = max(
                predict_model_states_mib(cls, strategy_cfg, cfg.optimizer, groups, ws),
                key=lambda p: sum(p.values()),
            )
            gathered = cls.transient_param_numel(strategy_cfg, blocks, root, ws) * param_bytes if blocks else 0
            parts = {
                "params_gib": states["params"] * MIB / GIB,
                "grads_gib": states["grads"] * MIB / GIB,
                "optimizer_gib": states["optimizer"] * MIB / GIB,
                "gathered_params_gib": gathered / GIB,
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
        rows = plan_rows(deeper, groups, [block_numel] * depth, root_numel, [ws])
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
    register_schemas()
    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_numeric_choices(argv))
    if cfg.plan.params is not None:
        n = int(cfg.plan.params)
        groups, blocks, root = [[(n,)]], [], n
    else:
        groups, blocks, root = model_shapes(cfg)
    params = sum(math.prod(s) for g in groups for s in g)
    rows = plan_rows(cfg, groups, blocks, root, list(cfg.plan.world_sizes))
    depth = largest_depth(cfg)
    if cfg.plan.format == "json":
        print(json.dumps({"params": params, "rows": rows, "largest_depth": depth}, indent=2))
    else:
        print(format_table(rows, depth, cfg, params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
