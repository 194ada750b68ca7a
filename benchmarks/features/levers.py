"""What each lever beyond sharding buys and costs, measured side by side (issue 24).

    python -m benchmarks.features.levers                 # everything below (about 15 minutes on 2 cores)
    python -m benchmarks.features.levers --only ac       # one part: ac, hsdp, compile, plan
    python -m benchmarks.features.levers --smoke         # tiny shapes, one strategy (CI's smoke run)

- ``ac``: ``model=gpt`` at sequence 512, batch 8, 2 CPU ranks, every strategy with
  ``trainer.activation_checkpointing`` none and full: measured peak (CPU tracker), the
  saving, the step-time cost, and predicted vs measured for each.
- ``hsdp``: fsdp at 4 ranks against ``strategy.replicate=2`` (2 x 2): peak and step time.
- ``compile``: ``trainer.compile`` against eager, step time and compile time, for gpt and
  hf_bert (2 ranks, ddp).
- ``plan``: a 7B plan (``model=gpt_7b``, 8 ranks x 80 GiB, bf16) with levers: the largest
  batch per rank that fits for each strategy and lever combination, and the cheapest
  combination that fits at batch 1.

Runs within one part alternate nothing and share the machine: compare within a table.
Prints Markdown tables; writes outputs/benchmarks/levers.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import markdown, run, save, strategy_names
from benchmarks.limits import COMMAND_TIMEOUT_S

STRATEGY_NAMES = strategy_names()


def _job(overrides: list[str], name: str) -> dict:
    common = ["logger=none", "trainer.progress_bar=false", "trainer.accelerator=cpu", "trainer.eval_batches=0"]
    result = run([*common, *overrides], f"levers/{name}")
    r = max(result["memory"]["per_rank"], key=lambda e: e["peak_allocated_mib"])
    return {
        "peak_mib": r["peak_allocated_mib"],
        "predicted_mib": r.get("predicted_peak_mib"),
        "error": r.get("peak_rel_error"),
        "activations_mib": (r.get("peak_breakdown_mib") or {}).get("Activation"),
        "step_s": result["throughput"]["step_time_s_median"],
        "compile_s": result["throughput"].get("compile_s"),
        "states_mib": sum(r["model_states_mib"].values()),
    }


def ac_part(smoke: bool) -> list[dict]:
    shape = ["model=gpt", "model.seq_len=64" if smoke else "model.seq_len=512", "trainer.batch_size=8",
             "trainer.world_size=2", "trainer.steps=8", "trainer.warmup_steps=2"]  # fmt: skip
    rows, out = [], []
    for strategy in STRATEGY_NAMES[:1] if smoke else STRATEGY_NAMES:
        none = _job([*shape, f"strategy={strategy}"], f"{strategy}_none")
        full = _job([*shape, f"strategy={strategy}", "trainer.activation_checkpointing=full"], f"{strategy}_full")
        point = {"strategy": strategy, "none": none, "full": full, "saving": 1 - full["peak_mib"] / none["peak_mib"],
                 "step_cost": full["step_s"] / none["step_s"] - 1}  # fmt: skip
        out.append(point)
        rows.append([strategy, f"{none['peak_mib']:.1f}", f"{full['peak_mib']:.1f}", f"{point['saving']:.0%}",
                     f"{none['activations_mib']:.1f} -> {full['activations_mib']:.1f}",
                     f"{none['step_s'] * 1e3:.0f} -> {full['step_s'] * 1e3:.0f} ({point['step_cost']:+.0%})",
                     f"{none['error']:+.1%} / {full['error']:+.1%}"])  # fmt: skip
    print(f"\nactivation checkpointing: {' '.join(shape)} (MiB per rank, CPU tracker)")
    print(markdown(["strategy", "peak, none", "peak, full AC", "saving", "activations", "step ms", "predicted error"],
                   rows))  # fmt: skip
    return out


def hsdp_part(smoke: bool) -> dict:
    shape = ["model=gpt", "model.seq_len=64" if smoke else "model.seq_len=256", "trainer.batch_size=8",
             "trainer.world_size=4", "trainer.steps=8", "trainer.warmup_steps=2", "strategy=fsdp"]  # fmt: skip
    fsdp, hsdp = _job(shape, "fsdp4"), _job([*shape, "strategy.replicate=2"], "hsdp2x2")
    print(f"\nHSDP: {' '.join(shape)}")
    print(markdown(["", "peak MiB", "states MiB", "step ms", "predicted error"],
                   [[name, f"{p['peak_mib']:.1f}", f"{p['states_mib']:.2f}", f"{p['step_s'] * 1e3:.0f}",
                     f"{p['error']:+.1%}"] for name, p in (("fsdp, 4 shards", fsdp), ("hsdp, 2 x 2", hsdp))]))  # fmt: skip
    return {"fsdp": fsdp, "hsdp": hsdp}


def compile_part(smoke: bool) -> list[dict]:
    models = {"gpt": ["model=gpt"], "hf_bert": ["model=hf_bert", "model.seq_len=16" if smoke else "model.seq_len=64",
                                                "trainer.batch_size=8"]}  # fmt: skip
    out, rows = [], []
    for name, model in list(models.items())[:1] if smoke else models.items():
        shape = [*model, "trainer.world_size=2", "trainer.steps=10", "trainer.warmup_steps=2"]
        eager, compiled = _job(shape, f"{name}_eager"), _job([*shape, "trainer.compile=true"], f"{name}_compiled")
        out.append({"model": name, "eager": eager, "compiled": compiled})
        rows.append([name, f"{eager['step_s'] * 1e3:.0f}", f"{compiled['step_s'] * 1e3:.0f}",
                     f"{compiled['step_s'] / eager['step_s']:.2f}", f"{compiled['compile_s']:.1f}"])  # fmt: skip
    print("\ncompile vs eager, 2 CPU ranks, ddp")
    print(markdown(["model", "eager step ms", "compiled step ms", "compiled / eager", "compile s"], rows))
    return out


def plan_part(smoke: bool) -> dict:
    # (the smoke: a small model against a small budget, so plan.find stops at a small batch)
    model = ["model=gpt", "plan.device_memory_gib=0.05"] if smoke else \
        ["model=gpt_7b", "plan.device_memory_gib=80"]  # fmt: skip
    strategies = "plan.strategies=[fsdp]" if smoke else "plan.strategies=[ddp,zero1,fsdp]"
    args = [*model, "precision=bf16", "plan.world_sizes=[8]", "plan.format=json", strategies,
            "plan.levers=[none,ac,ac+offload]"]  # fmt: skip
    at_one = json.loads(_plan([*args, "trainer.batch_size=1"]))
    found = json.loads(_plan([*args, "plan.find=batch_size"]))
    print(f"\nplan: {' '.join(args[:-2])} ({found['params']:,} params)")
    peaks = {(r["strategy"], r["levers"]): r for r in at_one["rows"]}
    rows = [[f["strategy"], f["levers"], f"{peaks[f['strategy'], f['levers']]['total_gib']:.1f}",
             "yes" if peaks[f["strategy"], f["levers"]]["fits"] else "no", f["value"]] for f in found["found"]]  # fmt: skip
    print(markdown(["strategy", "levers", "peak GiB at batch 1", "fits at batch 1", "largest batch that fits"], rows))
    print("cheapest that fits at batch 1:", at_one["cheapest"])
    return {"batch_1": at_one, "found": found["found"]}


def _plan(args: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp.plan", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=["ac", "hsdp", "compile", "plan"])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    parts = {"ac": ac_part, "hsdp": hsdp_part, "compile": compile_part, "plan": plan_part}
    data = {name: fn(args.smoke) for name, fn in parts.items() if not args.only or name in args.only}
    print(f"wrote {save('levers', {'args': vars(args), **data})}")


if __name__ == "__main__":
    main()
