"""One published case's predicted step, broken down: where the time model puts its seconds.

    python -m benchmarks.accuracy.step_breakdown            # Llama 3.1 8B, FSDP x8 H100 (the first case)
    python -m benchmarks.accuracy.step_breakdown --case 2   # another case of step_time_published, by index

The case is planned as :mod:`benchmarks.accuracy.step_time_published` plans it (its trace, its
profile, its machine), and the step is split by op class (matmul, attention, memory-bound
``other``) and phase at the model's full depth, as the planner deepens a trace cut to a few
units. The backward's matmuls include activation checkpointing's recomputation; a matmul's
backward does exactly twice its forward's FLOPs, so what the backward does beyond twice the
forward is the recomputation (priced at the backward's average rate). An attention kernel's
recomputed forward is recorded by name (``attention.forward`` inside the backward). Beside the
model's seconds: the step the published tokens/s implies, and what is left between the two.

Prints Markdown; writes outputs/benchmarks/step_breakdown.json.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.accuracy.step_time_published import CASES
from benchmarks.common import markdown, save
from sharded_exp.compose import compose
from sharded_exp.plan.depth import shapes_of
from sharded_exp.plan.points import _layer_key, with_strategy
from sharded_exp.plan.speed import machine, speed_columns, traced
from sharded_exp.precision import Precision
from sharded_exp.predict.op_trace import Trace
from sharded_exp.predict.prediction import predict
from sharded_exp.predict.step_time import math_dtype, per_step, step_compute
from sharded_exp.speed.compute import OP_KINDS, classify


def _setting(overrides: list[str], key: str) -> str:
    """The value of ``key=[value]`` among a case's overrides (one world size, one lever)."""
    [found] = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return found.strip("[]")


def only(trace: Trace, kind: str) -> Trace:
    """``trace`` with every op not of ``kind`` made free (no FLOPs, no bytes: a named GPU's
    profile then prices it at 0), so that pricing it gives ``kind``'s share of the step, split
    and deepened exactly as the planner does it."""

    def keep(record) -> bool:
        return classify(record["op"]) == kind

    free = {"flops": 0, "input_bytes": 0, "output_bytes": 0}
    return Trace([r if keep(r) else {**r, **free} for r in trace.records], trace.units)


def deepened(trace: Trace, dev, dtype: str, layers: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(phase, op class) -> (seconds, FLOPs) at ``layers`` units, each class priced alone by
    :func:`~sharded_exp.predict.step_time.step_compute` and deepened by
    :meth:`~sharded_exp.predict.step_time.StepCompute.at_depth`, as the planner prices the step
    (the optimizer here unsharded: the planner then scales it by the rank's share; each class's
    backward follows its own forward, so the classes sum to the planned compute). FLOPs in the
    backward are scaled as the forward's are; an attention call's FLOPs as counted (a causal
    kernel does half)."""
    out = {}
    for kind in OP_KINDS:
        part = only(trace, kind)
        records = part.phased()
        flops = {ph: sum(r["flops"] for r in records if r["phase"] == ph) for ph in ("forward", "backward")}
        again = sum(r["flops"] for r in records if r["phase"] == "backward" and "forward" in r["op"])
        c = step_compute(part, dev, 0.0, dtype)
        deep = c.at_depth(layers)
        scale = sum(deep.forward_flops) / sum(c.forward_flops) if sum(c.forward_flops) else 1.0
        out[("forward", kind)] = (sum(deep.forward_s), flops["forward"] * scale)
        out[("backward", kind)] = (sum(deep.backward_s), flops["backward"] * scale)
        out[("optimizer", kind)] = (deep.optimizer_s, 0.0)
        if kind == "attention":  # the kernel's recomputed forward, by its name (attention.forward)
            ratio = again / flops["backward"] if flops["backward"] else 0.0
            out[("recomputed", kind)] = (sum(deep.backward_s) * ratio, again * scale)
    return out


def breakdown(index: int) -> dict:
    case = CASES[index]
    cfg = compose(case.overrides, "plan")
    cfg_s = with_strategy(cfg, str(cfg.plan.strategies[0]), _setting(case.overrides, "plan.levers"))
    world_size = int(_setting(case.overrides, "plan.world_sizes"))
    found = traced(cfg_s, "cuda", _layer_key(cfg.model))
    at = machine(cfg_s, world_size)
    shapes = shapes_of(cfg_s)
    prediction = predict(cfg_s.strategy, cfg_s.optimizer, str(Precision.of(cfg_s)), shapes, world_size)
    row = speed_columns(cfg_s, world_size, found, prediction)
    parts = deepened(found["trace"], at.device, math_dtype(cfg_s), len(list(shapes.blocks)))
    mm_fwd, mm_bwd = parts[("forward", "matmul")], parts[("backward", "matmul")]
    recompute_flops = max(0.0, mm_bwd[1] - 2 * mm_fwd[1])
    recompute_s = mm_bwd[0] * recompute_flops / mm_bwd[1] if mm_bwd[1] else 0.0
    _, tokens = per_step(cfg_s)
    published_step = tokens / case.tokens_per_s
    return {
        "case": case.name, "profile": at.device.name, "world_size": world_size,
        "parts": {f"{p}/{k}": {"seconds": s, "tflop": f / 1e12} for (p, k), (s, f) in parts.items()},
        "matmul_recomputed": {"seconds": recompute_s, "tflop": recompute_flops / 1e12},
        "planned": {k: row.get(k) for k in ("compute_s", "optimizer_s", "comm_s", "exposed_comm_s", "step_time_s",
                                             "tokens_per_s_per_device", "mfu_pct")},
        "published_tokens_per_s": case.tokens_per_s, "published_step_s": published_step,
        "missing_s": published_step - row["step_time_s"],
    }  # fmt: skip


def table(b: dict) -> str:
    p = b["parts"]
    rows = []
    for kind, label in (("matmul", "matmul"), ("attention", "attention (fused kernel)"),
                        ("other", "memory-bound (elementwise, norms, copies, casts, loss)")):  # fmt: skip
        fwd, bwd = p[f"forward/{kind}"], p[f"backward/{kind}"]
        again = b["matmul_recomputed"] if kind == "matmul" else p.get(f"recomputed/{kind}")
        note = f"{again['seconds']:.3f} s ({again['tflop']:.0f} TFLOP) of it recomputed" if again else ""
        rows.append([label, f"{fwd['seconds']:.3f}", f"{bwd['seconds']:.3f}", note])
    planned = b["planned"]
    rows.append(["optimizer step (this rank's shard)", "", "", f"{planned['optimizer_s']:.4f} s"])
    rows.append(["host (launches: overlapped on a GPU, 0 for a named profile)", "", "", "0"])
    rows.append(
        ["communication (all / exposed)", "", "", f"{planned['comm_s']:.3f} / {planned['exposed_comm_s']:.3f} s"]
    )
    rows.append(["step (planned)", "", "", f"{planned['step_time_s']:.3f} s, {planned['tokens_per_s_per_device']:,.0f} "
                 f"tokens/s, MFU {planned['mfu_pct']:.1f}%"])  # fmt: skip
    rows.append(
        ["step (published)", "", "", f"{b['published_step_s']:.3f} s, {b['published_tokens_per_s']:,.0f} tokens/s"]
    )
    rows.append(["left to explain", "", "", f"{b['missing_s']:.3f} s"])
    head = f"{b['case']} on {b['profile']} (world size {b['world_size']}), seconds a step at full depth:\n\n"
    return head + markdown(["part", "forward s", "backward s (recomputation included)", "note"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", type=int, default=0, help=f"index into step_time_published's cases (0-{len(CASES) - 1})"
    )
    args = parser.parse_args()
    if not 0 <= args.case < len(CASES):
        parser.error(f"--case must be 0 to {len(CASES) - 1}, not {args.case}")
    b = breakdown(args.case)
    print(table(b))
    save("step_breakdown", b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
