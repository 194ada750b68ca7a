"""The CUDA path on a GPU machine: every strategy and precision at world size 1.

    python -m benchmarks.accuracy.gpu_check                         # on a machine with CUDA (NCCL, 1 GPU)
    python -m benchmarks.accuracy.gpu_check --accelerator cpu --steps 3 --strategies ddp fsdp   # dry run

    python -m benchmarks.accuracy.gpu_check --predict h200          # here, before: the planner's figures

One job per (strategy, precision), each through the real launcher (a GPT of about 100M
parameters, batch 8 x 512 tokens), side by side with what was predicted for it (signed
errors: below zero the prediction was too low):

- CUDA peak allocated against the parent's fake step plus the allocator's rounding, and peak
  reserved (``torch.cuda.memory_stats``) against the fake step's allocations replayed through
  the allocator model; allocation retries; model states walked against the memory model;
- the median step time against the run's own prediction (``throughput.predicted_step_time_s``:
  its fake step priced on the ``this`` profile, the GPU measured in a child process), and
  against the planner's figure on a sourced profile (``gpu_check_sourced.json``, written by
  ``--predict PROFILE`` on a machine without a GPU, before the check ran); MFU measured.

Prints one Markdown table; writes outputs/benchmarks/gpu_check.json after every job. Exit
code 1 if any job failed or a model-state prediction is off by more than 2%.

    python -m benchmarks.accuracy.gpu_check --hang                  # NCCL hang diagnosis on one GPU

``--hang`` runs one job whose rank stalls its GPU at step 3 (fault ``stall``: the step's
collectives wait behind a sleeping kernel past ``trainer.timeout_s``), and reports how
long the job took to end, its error, and whether torch's flight recorder dumped
``nccl_trace_rank_0`` into the run directory (read it with ``torchfrtrace``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import OUT, markdown, run, save, strategy_names
from benchmarks.limits import COMMAND_TIMEOUT_S

STRATEGY_NAMES = strategy_names()
PRECISIONS = ["bf16", "16", "32"]
MODEL = ["model=gpt", "model.d_model=1024", "model.n_layers=8", "model.n_heads=16", "model.seq_len=512"]
BATCH = 8
SOURCED = Path(__file__).with_name("gpu_check_sourced.json")
"""The planner's predictions for this check's jobs on a sourced GPU profile, made before any
GPU ran them (``--predict PROFILE``): step time, allocated and reserved, per precision and
strategy."""


def predict_sourced(profile: str, model: list[str], precisions: list[str]) -> int:
    """Run the planner (fake CUDA steps, on this machine's CPU) for the check's jobs of
    ``model`` and write its figures on ``profile`` into :data:`SOURCED` (one entry per model)."""
    figures = {}
    for prec in precisions:
        cmd = [sys.executable, "-m", "sharded_exp.plan", *model, f"precision={prec}", f"trainer.batch_size={BATCH}",
               "plan.device=cuda", f"plan.device_profile={profile}", "plan.world_sizes=[1]", "plan.alloc_conf=",
               "plan.format=json"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=COMMAND_TIMEOUT_S)
        rows = json.loads(proc.stdout)["rows"]
        figures[prec] = {
            r["strategy"]: {k: r.get(k) for k in ("step_time_s", "mfu_pct", "allocated_gib", "reserved_gib")}
            for r in rows
        }
        print(
            f"precision {prec}: " + ", ".join(f"{k} {v['step_time_s'] * 1e3:.2f} ms" for k, v in figures[prec].items())
        )
    doc = (
        json.loads(SOURCED.read_text()) if SOURCED.exists() else {"profile": profile, "batch_size": BATCH, "cases": {}}
    )
    if doc["profile"] != profile:
        raise SystemExit(f"{SOURCED} holds profile {doc['profile']}, not {profile}: move it aside first")
    doc["cases"][" ".join(model)] = {"made": time.strftime("%Y-%m-%d"), "figures": figures,
                                     "command": f"python -m benchmarks.accuracy.gpu_check --predict {profile} "
                                                f"--model {' '.join(model)} --precisions {' '.join(precisions)}"}  # fmt: skip
    SOURCED.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {SOURCED}")
    return 0


def _rel(predicted, measured):
    return None if predicted is None or not measured else (predicted - measured) / measured


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--strategies", nargs="+", default=STRATEGY_NAMES)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", nargs="+", default=MODEL, help="the model's overrides")
    parser.add_argument("--name", default="gpu_check", help="the output's name (outputs/benchmarks/NAME.json)")
    parser.add_argument("--hang", action="store_true", help="only the NCCL hang case")
    parser.add_argument("--predict", metavar="PROFILE", help="only write the planner's figures on PROFILE")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="trainer.timeout_s of the hang case")
    args = parser.parse_args()
    if args.predict:
        return predict_sourced(args.predict, args.model, args.precisions)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or --accelerator cpu for a dry run", file=sys.stderr)
        return 2
    if args.hang:
        return hang_case(args)
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    sourced = json.loads(SOURCED.read_text()) if SOURCED.exists() else {}
    case = sourced.get("cases", {}).get(" ".join(args.model), {})

    rows, data, bad = [], [], 0
    for prec in args.precisions:
        for strategy in args.strategies:
            overrides = [*args.model, f"strategy={strategy}", f"precision={prec}",
                         f"trainer.accelerator={args.accelerator}", "trainer.world_size=1", f"trainer.steps={args.steps}",
                         f"trainer.warmup_steps={min(5, args.steps // 2)}", f"trainer.batch_size={BATCH}", "trainer.eval_batches=0",
                         "trainer.progress_bar=false", "logger=none"]  # fmt: skip
            t0 = time.perf_counter()
            try:
                result = run(overrides, f"{args.name}/{strategy}_{prec}")
            except Exception as exc:  # noqa: BLE001 -- one failed job is a row, the check goes on
                bad += 1
                rows.append([strategy, prec, "failed", str(exc).replace("\n", " ")[:120]] + [""] * 11)
                print(f"{strategy} {prec}: FAILED {exc}", flush=True)
                continue
            mem, speed = result["memory"], result["throughput"]
            rank = mem["per_rank"][0]
            extra = ((mem.get("peak_prediction") or {}).get("allocator") or {}).get("allocated_extra_mib")
            allocated = (
                None if rank.get("predicted_peak_mib") is None or extra is None else rank["predicted_peak_mib"] + extra
            )
            measured_step = speed.get("step_time_s_median")
            this_step = speed.get("predicted_step_time_s")
            source = case.get("figures", {}).get(prec, {}).get(strategy) or {}
            sourced_step = source.get("step_time_s")
            entry = {
                "strategy": strategy, "precision": prec, "job_s": time.perf_counter() - t0,
                "peak_allocated_mib": rank.get("peak_allocated_mib"), "predicted_allocated_mib": allocated,
                "peak_reserved_mib": rank.get("peak_reserved_mib"),
                "predicted_reserved_mib": rank.get("predicted_peak_reserved_mib"),
                "reserved_why_null": mem.get("predicted_peak_reserved_error"),
                "alloc_retries": rank.get("alloc_retries"),
                "states_rel_error": mem.get("model_states_rel_error_max"),
                "step_time_s_median": measured_step, "step_time_s_ci95": [speed.get("step_time_s_ci95_low"),
                                                                         speed.get("step_time_s_ci95_high")],
                "predicted_step_time_s_this": this_step, "step_time_prediction": speed.get("step_time_prediction"),
                "predicted_step_time_s_sourced": sourced_step, "sourced_profile": sourced.get("profile"),
                "sourced": source, "mfu_pct": speed.get("mfu_pct"), "tokens_per_s": speed.get("tokens_per_s"),
                # CPU offload: the pinned host blocks torch holds, against the prediction's (sharded_exp/predict/host_memory.py)
                "pinned_host_mib": rank.get("pinned_host_mib"),
                "predicted_pinned_host_mib": ((mem.get("peak_prediction") or {}).get("host_breakdown_mib") or {}).get("pinned"),
            }  # fmt: skip
            data.append(entry)
            error = entry["states_rel_error"]
            bad += int(error is None or error > 0.02)
            rows.append([
                strategy, prec,
                _num(entry["peak_allocated_mib"]), _num(allocated), _pct(_rel(allocated, entry["peak_allocated_mib"])),
                _num(entry["peak_reserved_mib"]), _num(entry["predicted_reserved_mib"]),
                _pct(_rel(entry["predicted_reserved_mib"], entry["peak_reserved_mib"])), entry["alloc_retries"],
                _pct(error), _num(measured_step and measured_step * 1e3, ".2f"), _num(this_step and this_step * 1e3, ".2f"),
                _pct(_rel(this_step, measured_step)), _num(sourced_step and sourced_step * 1e3, ".2f"),
                _pct(_rel(sourced_step, measured_step)), _num(entry["mfu_pct"]),
            ])  # fmt: skip
            if entry["predicted_pinned_host_mib"] is not None:  # an offloaded job
                pinned, said = entry["pinned_host_mib"], entry["predicted_pinned_host_mib"]
                print(f"{strategy} {prec}: pinned host memory {_num(pinned)} MiB, predicted {_num(said)} MiB "
                      f"({_pct(_rel(said, pinned))}; the data loader's pinned batches are not predicted)", flush=True)  # fmt: skip
            print(f"{strategy} {prec}: done in {entry['job_s']:.1f} s", flush=True)
            save(args.name, {"device": device, "torch": torch.__version__, "args": vars(args), "results": data})
    print(
        f"{device}; torch {torch.__version__}; world size 1; {' '.join(args.model)}; batch {BATCH}; {args.steps} steps"
    )
    header = ["strategy", "precision", "alloc MiB", "pred alloc", "err", "reserved MiB", "pred reserved", "err",
              "retries", "states err", "step ms", "pred ms (this)", "err", f"pred ms ({sourced.get('profile')})",
              "err", "MFU %"]  # fmt: skip
    print(markdown(header, rows))
    path = save(args.name, {"device": device, "torch": torch.__version__, "args": vars(args), "results": data})
    print(f"wrote {path}")
    return 1 if bad else 0


def hang_case(args) -> int:
    """One rank, a device stall at step 3 that outlasts trainer.timeout_s."""
    out = OUT / "gpu_check" / "hang"
    env = {
        **os.environ,
        "SHARDED_EXP_FAULT": "rank=0,step=3,kind=stall",
        "SHARDED_EXP_STALL_S": str(3 * args.timeout_s),
    }
    cmd = [sys.executable, "-m", "sharded_exp", *MODEL, "strategy=ddp", f"trainer.accelerator={args.accelerator}",
           "trainer.world_size=1", "trainer.steps=10", "trainer.warmup_steps=1", f"trainer.timeout_s={args.timeout_s}",
           "trainer.progress_bar=false", "logger=none", f"hydra.run.dir={out}"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=10 * args.timeout_s + 120)
    seconds = time.time() - t0
    traces = sorted(p.name for p in out.glob("nccl_trace_rank_*"))
    print(
        f"hang case: exit {proc.returncode} after {seconds:.1f} s (timeout_s={args.timeout_s:g}); flight recorder dumps: {traces or 'none'}"
    )
    print(
        markdown(
            ["exit", "seconds", "dumps", "error"],
            [
                [
                    proc.returncode,
                    f"{seconds:.1f}",
                    len(traces),
                    proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else "",
                ]
            ],
        )
    )
    save(
        "gpu_check_hang", {"exit": proc.returncode, "seconds": seconds, "traces": traces, "stderr": proc.stderr[-4000:]}
    )
    return 0 if proc.returncode != 0 and (traces or args.accelerator == "cpu") else 1


if __name__ == "__main__":
    sys.exit(main())
