"""The whole job against a hand-written DDP script: what a user pays around the loop.

    python -m benchmarks.harness.job_vs_script                  # 5 paired runs, 8 x 1024 MLP, 40 steps
    python -m benchmarks.harness.job_vs_script --pairs 1 --steps 5 --depth 2 --hidden 64   # smoke
    python -m benchmarks.harness.job_vs_script --job trainer.host_mmap_threshold=fixed      # the job with more overrides

Each pair runs, back to back and in alternating order, ``python -m sharded_exp`` (DDP, 2
ranks, Adam, the teacher task, W&B off, everything else as configured: the parent's
peak prediction, the evaluation pass, result.json, the table) and a 40-line script of
the kind a user types: ``mp.spawn``, gloo, DDP, the same MLP and the same batches, a plain
loop that only reads a clock around each step. Both are timed from the command to its
exit, as whole processes. The ratio of each pair (job / script) is reported, with its
median; so are each side's command-to-first-step time and median step after the job's
warm-up (the job's from its result.json, the script's printed by its rank 0), and the job's
last-step-to-exit time: they say whether a gap is in the steps or around them. The job runs its default malloc rule (``trainer.host_mmap_threshold=reuse``)
and the script glibc's own; this MLP's step faults in almost no page under either (2 to 104 a
step, docs/figures.md), so the rule does not favour the job here (``--job
trainer.host_mmap_threshold=dynamic`` runs it like the script).
Prints a Markdown table and writes outputs/benchmarks/job_vs_script.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import OUT, command_env, markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.nn as nn, torch.nn.functional as F

DEPTH, HIDDEN, BATCH, STEPS, WARMUP = (int(a) for a in sys.argv[1:6])

def mlp():
    layers, width = [], 64
    for _ in range(DEPTH):
        layers += [nn.Sequential(nn.Linear(width, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN))]
        width = HIDDEN
    return nn.Sequential(*layers, nn.Linear(width, 10))

def worker(rank, world_size, port):
    torch.set_num_threads(max(1, os.cpu_count() // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(64, 32, generator=g), torch.randn(32, 10, generator=g)
    times = []
    for step in range(STEPS):
        x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(step * 7919 + rank))
        y = (torch.tanh(x @ w1) @ w2).argmax(1)
        t0 = time.perf_counter()  # the step, not the batch's making (the job's step time leaves its data out too)
        if step == 0:
            first_step_at = time.time()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:  # for the benchmark, not a thing a user would print: the steps after the job's warm-up
        print("step_s", sorted(times[WARMUP:])[len(times[WARMUP:]) // 2])
        print("first_step_at", first_step_at)
    dist.barrier()
    del model, opt
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29500 + os.getpid() % 1000), nprocs=2)
"""


def timed(cmd: list[str], bytecode_cache: bool = True) -> tuple[float, str]:
    """The command's wall time, command to exit, and its standard output, in
    :func:`benchmarks.common.command_env`'s environment: the job's package cached or compiled
    anew; the hand script runs from source either way (a script is never cached) and imports
    only torch."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=command_env(bytecode_cache)
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return time.perf_counter() - t0, proc.stdout


def printed(stdout: str, name: str) -> float:
    """A figure the hand script's rank 0 printed: ``step_s``, its median step after the job's
    warm-up, or ``first_step_at``, the Unix time its first step began."""
    return float(next(line.split()[1] for line in stdout.splitlines() if line.startswith(name + " ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--no-bytecode-cache", dest="bytecode_cache", action="store_false",
                        help="run the job as this project's machines do (its package compiled anew), not as a user's Python")  # fmt: skip
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--job", nargs="*", default=[], metavar="OVERRIDE",
                        help="more overrides for the job (not the model, batch, steps or run directory: the script mirrors those)")  # fmt: skip
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="job_vs_script_")
    script = os.path.join(workdir, "hand_ddp.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    warmup = min(5, args.steps - 1)
    sizes = [str(args.depth), str(args.hidden), str(args.batch_size), str(args.steps), str(warmup)]
    pairs = []
    for i in range(args.pairs):
        out = os.path.join(workdir, f"job{i}")
        job = [sys.executable, "-m", "sharded_exp", "strategy=ddp", "model=mlp", f"model.depth={args.depth}",
               f"model.hidden={args.hidden}", f"trainer.batch_size={args.batch_size}", f"trainer.steps={args.steps}", f"trainer.warmup_steps={warmup}",
               "trainer.world_size=2", "trainer.accelerator=cpu", "logger=none", "trainer.progress_bar=false",
               f"hydra.run.dir={out}", *args.job]  # fmt: skip
        hand = [sys.executable, script, *sizes]
        t = {}
        for side in ("job", "script") if i % 2 == 0 else ("script", "job"):
            t0 = time.time()
            t[side], stdout = timed(job if side == "job" else hand, args.bytecode_cache)
            if side == "job":
                t["job_started"] = t0
            else:
                t["script_step_s"] = printed(stdout, "step_s")
                t["script_to_first_step_s"] = printed(stdout, "first_step_at") - t0
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
        timeline = result["timeline"]
        pairs.append(
            {
                **t,
                "ratio": t["job"] / t["script"],
                "to_first_step_s": timeline["first_step"] - t["job_started"],
                "last_step_to_exit_s": t["job_started"] + t["job"] - timeline["last_step"],
                "eval_s": (result.get("eval") or {}).get("seconds"),
                "job_step_s": result["throughput"]["step_time_s_median"],
                "last_step": timeline["last_step"],
            }
        )  # fmt: skip
    rows = [[i, f"{p['job']:.2f}", f"{p['script']:.2f}", f"{p['ratio']:.2f}",
             f"{p['to_first_step_s']:.2f} / {p['script_to_first_step_s']:.2f}",
             f"{p['last_step_to_exit_s']:.2f}", f"{p['eval_s'] or 0:.2f}",
             f"{1000 * p['job_step_s']:.1f} / {1000 * p['script_step_s']:.1f}"] for i, p in enumerate(pairs)]  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    rows.append(["**median**", "", "", f"**{statistics.median(ratios):.2f}**", "", "", "", ""])
    extra = f"; the job with {' '.join(args.job)}" if args.job else ""
    cache = "on (as a user's Python)" if args.bytecode_cache else "off (PYTHONDONTWRITEBYTECODE=1)"
    print(f"MLP {args.depth} x {args.hidden}, batch {args.batch_size}, {args.steps} steps, 2 ranks (seconds){extra}; "
          f"bytecode cache {cache}")  # fmt: skip
    print(
        markdown(
            [
                "pair",
                "job",
                "script",
                "job/script",
                "command to first step, job / script",
                "job's last step to exit",
                "of it evaluation",
                "step ms, job / script",
            ],  # fmt: skip
            rows,
        )
    )
    print(f"wrote {save('job_vs_script', {'args': vars(args), 'pairs': pairs})}")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
