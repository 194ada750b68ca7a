"""sharded_exp against PyTorch Lightning on the same job, side by side in one run.

    pip install -e ".[lightning]"
    python -m benchmarks.lightning_vs                    # MLP, fp32, DDP, 2 CPU ranks, 3 runs each
    python -m benchmarks.lightning_vs --repeats 1 --smoke

Both are started as a user would, from the command line, alternately:
``python -m sharded_exp strategy=ddp logger=none ...`` and ``python -m
benchmarks.lightning_job ...`` (the same model, data, optimizer, clipping, precision and
steps, Lightning's ``strategy="ddp"``). Measured for each: the median step time after the
warm-up, the loop time per step (whole iterations), command to first step, command to
exit, and the largest peak RSS over ranks. Prints a Markdown table, writes
outputs/benchmarks/lightning_vs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import OUT, markdown, save

JOB = ["strategy=ddp", "model=mlp", "precision=32", "trainer.world_size=2"]


def run_ours(overrides: list[str], out: str) -> dict:
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharded_exp",
            *overrides,
            "logger=none",
            "trainer.progress_bar=false",
            f"hydra.run.dir={out}",
        ],
        capture_output=True,
        text=True,
    )
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    return {
        "step_time_s_median": result["throughput"]["step_time_s_median"],
        "loop_time_s_per_step": result["throughput"]["loop_time_s_per_step"],
        "to_first_step_s": result["timeline"]["first_step"] - t0,
        "to_exit_s": wall,
        "peak_rss_mib_max": result["memory"]["peak_rss_mib_max"],
    }


def run_lightning(overrides: list[str], out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "lightning.json")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.lightning_job", "--out", path, *overrides],
        capture_output=True,
        text=True,
    )
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(path) as f:
        data = json.load(f)
    return {
        "step_time_s_median": statistics.median(data["step_time_s"]),
        "loop_time_s_per_step": data["loop_time_s_per_step"],
        "to_first_step_s": data["first_step_unix"] - t0,
        "to_exit_s": wall,
        "peak_rss_mib_max": max(data["peak_rss_mib"]),
        "lightning": data["lightning"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few steps, one run each (CI)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    overrides = [*JOB, f"trainer.steps={args.steps}", f"trainer.warmup_steps={args.warmup}", *args.overrides]

    runs: dict[str, list[dict]] = {"sharded_exp": [], "lightning": []}
    for i in range(args.repeats):
        order = ("sharded_exp", "lightning") if i % 2 == 0 else ("lightning", "sharded_exp")
        for name in order:
            out = str(OUT / "lightning_vs" / f"{name}_{i}")
            runs[name].append(run_ours(overrides, out) if name == "sharded_exp" else run_lightning(overrides, out))

    keys = ["step_time_s_median", "loop_time_s_per_step", "to_first_step_s", "to_exit_s", "peak_rss_mib_max"]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    rows = []
    for key, unit, scale in [
        ("step_time_s_median", "ms", 1e3),
        ("loop_time_s_per_step", "ms", 1e3),
        ("to_first_step_s", "s", 1),
        ("to_exit_s", "s", 1),
        ("peak_rss_mib_max", "MiB", 1),
    ]:
        ours, theirs = med["sharded_exp"][key], med["lightning"][key]
        rows.append([f"{key} ({unit})", f"{ours * scale:.2f}", f"{theirs * scale:.2f}", f"{ours / theirs:.3f}"])
    print(
        f"{' '.join(overrides)}; medians of {args.repeats} alternating runs each; "
        f"Lightning {runs['lightning'][0]['lightning']}"
    )
    print(markdown(["measure", "sharded_exp", "Lightning", "ratio"], rows))
    step_ok = med["sharded_exp"]["step_time_s_median"] <= med["lightning"]["step_time_s_median"]
    start_ok = med["sharded_exp"]["to_first_step_s"] < med["lightning"]["to_first_step_s"]
    print(
        f"step time no worse than Lightning's: {'yes' if step_ok else 'no'}; shorter command to first step: {'yes' if start_ok else 'no'}"
    )
    print(f"wrote {save('lightning_vs', {'args': vars(args), 'runs': runs, 'medians': med})}")


if __name__ == "__main__":
    main()
