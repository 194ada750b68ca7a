"""The CUDA path checked on one GPU, in one prepared run (at most about 8 minutes).

    scripts/device_check.sh                                  # on the GPU machine (sets up, then runs this)
    python -m benchmarks.accuracy.device_check                        # on a machine with CUDA, set up already
    python -m benchmarks.accuracy.device_check --accelerator cpu --quick   # a dry run of the script itself, here

Each check runs the real thing (jobs through the real launcher, in this process as their
parent, or as a user's command) and adds a row to one summary table:

1. the parent's CUDA use: pre-flight of a GPU job, then a whole job, with this process as
   the parent: ``torch.cuda.is_initialized()`` stays False (item 3);
2. every strategy x precision 16 / bf16 at world size 1: CUDA peak allocated and reserved,
   allocation retries, model states against the memory model, and the peak the parent
   predicted against the peak measured, signed (below zero: the prediction was too low);
3. the Adam implementation a run builds and the one its fake step builds (foreach both);
4. fake steps for a GPU at world size 8 (the planner, every strategy, GPT-2 small);
5. MFU, throughput and predicted vs measured peak of hf_gpt2_small bf16 (fused attention);
6. the NCCL timeout path, spawned and under torchrun: a stalled step past
   ``trainer.timeout_s``, the job's end, its error naming the step, the flight recorder's dump;
7. async DCP checkpoints of FSDP's CUDA DTensors, and a resume from them;
8. ``trainer.memory_limit_mib`` on CUDA: a job over it ends ``oom``, and says what it bounds;
   the snapshot of the allocator's history it leaves (``memory_snapshot_rank0.pickle``) loads;
9. FSDP's CPU offload (``strategy.cpu_offload=true``): device peak with and without, predicted;
10. the step time recording the allocator's history costs (``benchmarks/features/memory_history_cost.py``).

Prints the summary table (and each check's own); writes outputs/benchmarks/device_check.json
(and copies it to $OUT when that is set, as on the device machine). Exit code 1 when a
check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import OUT, markdown, save, strategy_names
from sharded_exp.compose import compose

STRATEGY_NAMES = strategy_names()
MODEL = ["model=gpt", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.seq_len=256"]
QUICK_MODEL = ["model=gpt", "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32"]
"""--quick (the CPU dry run of this script): a model a CPU trains in seconds."""


class Checks:
    def __init__(self, accelerator: str):
        self.accelerator = accelerator
        self.rows: list[dict] = []

    def add(self, name: str, ok: bool, figures: str, **data) -> None:
        self.rows.append({"check": name, "ok": bool(ok), "figures": figures, **data})
        print(f"[{'ok' if ok else 'FAILED'}] {name}: {figures}", flush=True)

    def run(self, name: str, fn, *args) -> None:
        t0 = time.time()
        try:
            fn(self, *args)
        except Exception as exc:  # noqa: BLE001 -- one check failing must not hide the others
            self.add(name, False, f"{type(exc).__name__}: {str(exc)[:300]}", traceback=traceback.format_exc())
        print(f"  ({name}: {time.time() - t0:.1f} s)", flush=True)


def job(checks: Checks, overrides: list[str], name: str) -> dict:
    """One job through the real launcher, with this process as its parent."""
    from sharded_exp.launch.parent import launch

    out = OUT / "device_check" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = compose([*overrides, f"trainer.accelerator={checks.accelerator}", "logger=none",
                       "trainer.progress_bar=false"])  # fmt: skip
    return launch(cfg, str(out)).as_written()


def cli(checks: Checks, args: list[str], name: str, env: dict | None = None, torchrun: bool = False, timeout=300):
    """A user's command: ``python -m sharded_exp`` (or under torchrun) in its own process."""
    out = OUT / "device_check" / name
    if out.exists():
        shutil.rmtree(out)
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m"] if torchrun \
        else [sys.executable, "-m"]  # fmt: skip
    cmd = [*head, "sharded_exp", *args, f"trainer.accelerator={checks.accelerator}", "logger=none",
           "trainer.progress_bar=false", f"hydra.run.dir={out}"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    result_file = out / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return proc, result, time.time() - t0, out


def parent_cuda(checks: Checks) -> None:
    from sharded_exp.launch import preflight

    cfg = compose([*MODEL, "precision=bf16", f"trainer.accelerator={checks.accelerator}"])
    with tempfile.TemporaryDirectory() as tmp:
        checked = preflight.check(cfg, tmp)
    peak = checked.prediction["peak"]
    initialised = torch.cuda.is_initialized()
    checks.add("parent never starts CUDA (pre-flight)", not initialised and peak["error"] is None,
               f"device {checked.device_type}; cuda initialised in the parent: {initialised}; predicted peak "
               f"{max(peak['per_rank_mib'] or [0]):.1f} MiB ({peak.get('kernels')})")  # fmt: skip


def matrix(checks: Checks, strategies: list[str], precisions: list[str], steps: int) -> None:
    rows, bad = [], 0
    for strategy in strategies:
        for prec in precisions:
            overrides = [*MODEL, f"strategy={strategy}", f"precision={prec}", "trainer.world_size=1",
                         f"trainer.steps={steps}", "trainer.warmup_steps=2", "trainer.batch_size=8"]  # fmt: skip
            result = job(checks, overrides, f"matrix/{strategy}_{prec}")
            if result["status"] != "ok":
                bad += 1
                rows.append([strategy, prec, result["status"], (result.get("error") or "")[:80]] + [""] * 8)
                continue
            mem, tp = result["memory"], result["throughput"]
            r = mem["per_rank"][0]
            err, states_err = r.get("peak_rel_error"), mem["model_states_rel_error_max"]
            bad += int(states_err is None or states_err > 0.02 or err is None or abs(err) > 0.10)
            rows.append([strategy, prec, f"{r['peak_allocated_mib']:.1f}", f"{r.get('peak_reserved_mib') or 0:.1f}",
                         r.get("alloc_retries", "-"), f"{mem['model_states_mib_max']:.1f}",
                         f"{mem['predicted_model_states_mib_max']:.1f}", f"{states_err:.2%}",
                         "-" if r.get("predicted_peak_mib") is None else f"{r['predicted_peak_mib']:.1f}",
                         "-" if err is None else f"{err:+.1%}", f"{tp.get('tokens_per_s', 0):.0f}",
                         "-" if tp.get("mfu_pct") is None else f"{tp['mfu_pct']:.1f}"])  # fmt: skip
    header = ["strategy", "precision", "peak alloc MiB", "peak reserved MiB", "alloc retries", "states MiB",
              "predicted states MiB", "states error", "predicted peak MiB", "peak error", "tokens/s", "MFU %"]  # fmt: skip
    print(markdown(header, rows))
    initialised = torch.cuda.is_initialized()
    errors = [row[9] for row in rows if row[9] not in ("", "-")]
    checks.add("strategy x precision at world size 1", bad == 0 and not initialised,
               f"{len(rows)} jobs, {bad} off (status, states > 2% or peak > 10%); peak errors {', '.join(errors)}; "
               f"cuda initialised in the parent after them: {initialised}", table=rows)  # fmt: skip


def adam(checks: Checks) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharded_exp.measure.cuda_kernels import cuda_kernels
    from sharded_exp.optim import optimizer_spec

    cfg = compose(["optimizer=adam"]).optimizer
    device = "cuda" if checks.accelerator == "gpu" else "cpu"
    run_opt = optimizer_spec(cfg, torch.nn.Linear(8, 8, device=device)).build()
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_kernels():
        fake_opt = optimizer_spec(cfg, torch.nn.Linear(8, 8)).build()
    ran, faked = run_opt.param_groups[0]["foreach"], fake_opt.param_groups[0]["foreach"]
    checks.add("Adam: the run's and the fake step's", ran == faked or device == "cpu",
               f"run on {device}: foreach={ran}; fake step for a GPU: foreach={faked}")  # fmt: skip


def plan_at_8(checks: Checks) -> None:
    from sharded_exp.compose import compose
    from sharded_exp.plan import points as plan

    cfg = compose(["model=gpt2_small", "precision=bf16", "trainer.batch_size=4"], config_name="plan")
    t0 = time.time()
    rows = plan.plan_rows(cfg, [8], "cuda")
    seconds = time.time() - t0
    peaks = {r["strategy"]: r["total_gib"] for r in rows}
    ok = all(v is not None for v in peaks.values()) and len(peaks) == len(STRATEGY_NAMES)
    checks.add("fake steps for a GPU at world size 8 (GPT-2 small, bf16, batch 4)", ok,
               f"{seconds:.1f} s; peaks GiB " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items() if v))  # fmt: skip


def hf_gpt2_small(checks: Checks, steps: int, quick: bool) -> None:
    shape = ["trainer.batch_size=2", "model.seq_len=128"] if quick else ["trainer.batch_size=8"]
    overrides = ["model=hf_gpt2_small", "precision=bf16", *shape, "trainer.world_size=1",
                 f"trainer.steps={steps}", "trainer.warmup_steps=3", "trainer.eval_batches=0"]  # fmt: skip
    result = job(checks, overrides, "hf_gpt2_small")
    if result["status"] != "ok":
        checks.add("hf_gpt2_small bf16: MFU and the fused-attention prediction", False, result.get("error") or "")
        return
    tp, r = result["throughput"], result["memory"]["per_rank"][0]
    mfu, err = tp.get("mfu_pct"), r.get("peak_rel_error")
    checks.add("hf_gpt2_small bf16: MFU and the fused-attention prediction", err is not None and abs(err) <= 0.10,
               f"MFU {'-' if mfu is None else f'{mfu:.1f}%'} ({tp.get('peak_flops_source')}); "
               f"{tp.get('tokens_per_s', 0):.0f} tokens/s; data {tp.get('data_time_s_per_step', 0) * 1e3:.2f} ms "
               f"of a {tp['step_time_s_median'] * 1e3:.1f} ms step; peak {r['peak_allocated_mib']:.0f} MiB measured, "
               f"{r.get('predicted_peak_mib') or 0:.0f} predicted ({'-' if err is None else f'{err:+.1%}'})")  # fmt: skip


def hang(checks: Checks, torchrun: bool, timeout_s: float) -> None:
    label = "torchrun" if torchrun else "spawned"
    env = {"SHARDED_EXP_FAULT": "rank=0,step=3,kind=stall", "SHARDED_EXP_STALL_S": str(3 * timeout_s)}
    # One GPU: the stalled step's own collective times out (NCCL's watchdog). A CPU dry run
    # takes two gloo ranks: the other rank's collective times out waiting for the stalled one.
    world_size = 1 if checks.accelerator == "gpu" else 2
    args = [*MODEL, "strategy=ddp", f"trainer.world_size={world_size}", "trainer.steps=10", "trainer.warmup_steps=1",
            f"trainer.timeout_s={timeout_s}"]  # fmt: skip
    proc, result, seconds, out = cli(checks, args, f"hang_{label}", env, torchrun, timeout=10 * timeout_s + 120)
    dumps = sorted(p.name for p in out.glob("nccl_trace_rank_*"))
    error = (result or {}).get("error") or ""
    status = (result or {}).get("status")
    named = "step 3" in error
    ok = proc.returncode != 0 and status == "failed" and named and (bool(dumps) or checks.accelerator == "cpu")
    checks.add(f"NCCL timeout, {label}", ok,
               f"exit {proc.returncode} after {seconds:.1f} s (timeout_s={timeout_s:g}); status {status}; "
               f"flight recorder dumps {dumps or 'none'}; error: {error[:200]}")  # fmt: skip


def async_dcp(checks: Checks) -> None:
    common = [*MODEL, "strategy=fsdp", "precision=bf16", "trainer.world_size=1", "trainer.checkpoint_every=5",
              "trainer.checkpoint_async=true", "trainer.warmup_steps=1", "trainer.eval_batches=0"]  # fmt: skip
    proc, first, _, out = cli(checks, [*common, "trainer.steps=10"], "dcp")
    if first is None or first["status"] != "ok":
        checks.add("async DCP on CUDA DTensors, and resume", False, (first or {}).get("error") or proc.stderr[-300:])
        return
    ckpt = out / "checkpoints"
    resumed_proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp", *common, "trainer.steps=15", "trainer.resume=auto",
         f"trainer.checkpoint_dir={ckpt}", f"trainer.accelerator={checks.accelerator}", "logger=none",
         "trainer.progress_bar=false", f"hydra.run.dir={out}_resumed"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    resumed_file = Path(f"{out}_resumed") / "result.json"
    resumed = json.loads(resumed_file.read_text()) if resumed_file.exists() else {}
    ok = resumed.get("status") == "ok" and resumed.get("start_step") == 10 and resumed.get("steps_done") == 15
    checks.add("async DCP on CUDA DTensors, and resume", ok,
               f"saved {first.get('checkpoint')}; resumed from step {resumed.get('start_step')} to "
               f"{resumed.get('steps_done')}, status {resumed.get('status')} {resumed.get('error') or ''}"
               f"{'' if resumed_proc.returncode == 0 else resumed_proc.stderr[-200:]}")  # fmt: skip


def offload(checks: Checks) -> None:
    """FSDP's CPU offload on the GPU: trains, the device holds less than without it, and the
    parent's prediction (states moved to the host by rule) against the CUDA peak."""
    common = [*MODEL, "strategy=fsdp", "precision=bf16", "trainer.world_size=1", "trainer.steps=8",
              "trainer.warmup_steps=2", "trainer.eval_batches=0"]  # fmt: skip
    plain = job(checks, common, "offload_off")
    moved = job(checks, [*common, "strategy.cpu_offload=true"], "offload_on")
    if moved["status"] != "ok" or plain["status"] != "ok":
        checks.add("FSDP CPU offload", False, (moved.get("error") or plain.get("error") or "")[:300])
        return
    on, off = moved["memory"]["per_rank"][0], plain["memory"]["per_rank"][0]
    err = on.get("peak_rel_error")
    checks.add("FSDP CPU offload", on["peak_allocated_mib"] < off["peak_allocated_mib"],
               f"device peak {off['peak_allocated_mib']:.1f} -> {on['peak_allocated_mib']:.1f} MiB; predicted "
               f"{on.get('predicted_peak_mib') or 0:.1f} ({'-' if err is None else f'{err:+.1%}'}); step "
               f"{plain['throughput']['step_time_s_median'] * 1e3:.1f} -> "
               f"{moved['throughput']['step_time_s_median'] * 1e3:.1f} ms")  # fmt: skip


def memory_limit(checks: Checks) -> None:
    limit = 64 if MODEL != QUICK_MODEL else 2  # below the model's states and its step
    overrides = [*MODEL, "strategy=ddp", "trainer.world_size=1", "trainer.steps=4", "trainer.warmup_steps=1",
                 f"trainer.memory_limit_mib={limit}", "trainer.eval_batches=0"]  # fmt: skip
    result = job(checks, overrides, "memory_limit")
    applies = result.get("memory", {}).get("memory_limit_applies_to")
    checks.add("trainer.memory_limit_mib on CUDA", result["status"] == "oom",
               f"status {result['status']}; applies to: {applies}; {(result.get('error') or '')[:160]}")  # fmt: skip
    oom_snapshot(checks, result)


def oom_snapshot(checks: Checks, result: dict) -> None:
    """What the OOM above left (issue 25): on CUDA a snapshot of the allocator's history per
    rank that ran out (trainer.memory_snapshot=auto records it under a memory limit), which
    loads with pickle as torch's memory_viz reads it; on a CPU dry run the tracker's breakdown."""
    import pickle

    mem = result.get("memory", {})
    snapshot = mem.get("memory_snapshot") or {}
    if checks.accelerator == "cpu":
        b = mem.get("oom_breakdown") or {}
        ok = bool(b.get("by_category_mib")) and "on CPU" in (snapshot.get("reason") or "")
        checks.add("OOM snapshot per rank", ok, f"CPU dry run: breakdown {b.get('by_category_mib')} at step "
                   f"{b.get('step')} ({b.get('phase')}); snapshot: {snapshot.get('reason')}")  # fmt: skip
        return
    loaded = []
    for path in snapshot.get("files", []):
        with open(path, "rb") as f:
            data = pickle.load(f)
        loaded.append(f"{Path(path).name} {os.path.getsize(path) / 2**20:.1f} MiB, "
                      f"{len(data.get('segments', []))} segments, "
                      f"{sum(len(t) for t in data.get('device_traces', []))} trace entries")  # fmt: skip
    ok = bool(loaded) and all(Path(p).name.startswith("memory_snapshot_rank") for p in snapshot["files"])
    checks.add("OOM snapshot per rank", ok, f"recorded {snapshot.get('recorded')}; {'; '.join(loaded) or 'no file'}; "
               f"{snapshot.get('reason') or ''}")  # fmt: skip


def history_cost(checks: Checks, quick: bool) -> None:
    """The step time that recording the allocator's history costs (benchmarks/features/memory_history_cost.py)."""
    from benchmarks.features.memory_history_cost import MODEL as HISTORY_MODEL
    from benchmarks.features.memory_history_cost import measure

    data = measure(1 if quick else 2, 12 if quick else 30, MODEL if quick else HISTORY_MODEL)
    ratio = data["cost_ratio"]
    pairs = ", ".join(f"{1e3 * p['off_step_s']:.2f} -> {1e3 * p['on_step_s']:.2f} ms "
                      f"(snapshot {p['snapshot_mib'] or 0:.1f} MiB)" for p in data["pairs"])  # fmt: skip
    ok = ratio is not None or checks.accelerator == "cpu"
    checks.add("memory history cost", ok, f"{'null: ' + data['reason'] if ratio is None else f'{ratio:.3f}x'}; "
               f"{pairs}", **data)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a dry run: two strategies, fewer steps, no torchrun")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="trainer.timeout_s of the hang cases")
    parser.add_argument(
        "--only",
        nargs="+",
        help="only these checks: parent matrix adam plan mfu hang torchrun dcp limit offload history",
    )
    args = parser.parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or --accelerator cpu for a dry run", file=sys.stderr)
        return 2
    checks = Checks(args.accelerator)
    if args.quick:
        MODEL[:] = QUICK_MODEL
    t0 = time.time()
    # --quick (a dry run of the script): DDP and one sharded strategy are enough to exercise every check.
    strategies = ["ddp", "fsdp"] if args.quick else STRATEGY_NAMES
    steps = 4 if args.quick else 12
    plan = [
        ("parent", "parent never starts CUDA (pre-flight)", parent_cuda),  # first: nothing may touch CUDA before
        ("matrix", "strategy x precision at world size 1", matrix, strategies, ["16", "bf16"], steps),
        ("adam", "Adam: the run's and the fake step's", adam),
        ("plan", "fake steps for a GPU at world size 8", plan_at_8),
        ("mfu", "hf_gpt2_small bf16", hf_gpt2_small, steps + 8, args.quick),
        ("hang", "NCCL timeout, spawned", hang, False, args.timeout_s),
        ("torchrun", "NCCL timeout, torchrun", hang, True, args.timeout_s),
        ("dcp", "async DCP on CUDA DTensors, and resume", async_dcp),
        ("limit", "trainer.memory_limit_mib on CUDA", memory_limit),
        ("offload", "FSDP CPU offload", offload),
        ("history", "memory history cost", history_cost, args.quick),
    ]
    for key, name, fn, *fn_args in plan:
        gpu_only = key == "offload" and args.accelerator == "cpu"  # a CPU run refuses it
        chosen = key in args.only if args.only else not (args.quick and key == "torchrun") and not gpu_only
        if chosen:
            checks.run(name, fn, *fn_args)
    seconds = time.time() - t0
    # What ran it: from a job's result.json (the device it recorded), so this parent never asks CUDA.
    device = _device_of_a_job()
    print(f"\n{device or args.accelerator}; {seconds:.0f} s in all")
    print(markdown(["check", "ok", "figures"], [[r["check"], "yes" if r["ok"] else "**no**", r["figures"]]
                                                for r in checks.rows]))  # fmt: skip
    path = save("device_check", {"device": device, "seconds": seconds, "args": vars(args), "checks": checks.rows})
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / "device_check.json")
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in checks.rows) else 1


def _device_of_a_job() -> dict | None:
    for path in sorted((OUT / "device_check" / "matrix").glob("*/result.json")):
        return json.loads(path.read_text()).get("device")
    return None


if __name__ == "__main__":
    sys.exit(main())
