"""Command to first step and command to exit for the default job, with where the time goes.

    python -m benchmarks.harness.startup                 # the default job (W&B offline), 3 runs
    python -m benchmarks.harness.startup --repeats 5 logger=none

Runs ``python -m sharded_exp [overrides]`` as a user does and reads the timeline that
``result.json`` keeps (Unix times: the entry point before its imports, the launch,
validation, a rank's start, its process group, model and strategy built, tracker ready,
first step). Prints a Markdown table and writes outputs/benchmarks/startup.json.
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

PHASES = [
    ("python start", "command", "main"),
    ("imports (rank server starts meanwhile)", "main", "imported"),
    ("Hydra compose", "imported", "launch"),
    ("validate (meta-device model)", "launch", "validated"),
    ("start ranks (forkserver)", "validated", "rank_start"),
    ("process group", "rank_start", "process_group_ready"),
    ("model + strategy", "process_group_ready", "built"),
    ("tracker (W&B) start", "built", "logger_ready"),
    ("to first step", "logger_ready", "first_step"),
    ("steps, results, exit", "first_step", "exit"),
]


def one(overrides: list[str], out: str) -> dict[str, float]:
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp", *overrides, f"hydra.run.dir={out}"], capture_output=True, text=True
    )
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(out, "result.json")) as f:
        timeline = json.load(f)["timeline"]
    return {"command": t0, **timeline, "exit": exited}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="config overrides (default: none, the default job)")
    args = parser.parse_args()

    runs = [one(args.overrides, str(OUT / "startup" / str(i))) for i in range(args.repeats)]
    rows = []
    for label, a, b in PHASES:
        seconds = [r[b] - r[a] for r in runs]
        rows.append([label, f"{statistics.median(seconds):.2f}"])
    first = [r["first_step"] - r["command"] for r in runs]
    total = [r["exit"] - r["command"] for r in runs]
    rows.append(
        ["**command to first step**", f"**{statistics.median(first):.2f}** ({min(first):.2f}-{max(first):.2f})"]
    )
    rows.append(["**command to exit**", f"**{statistics.median(total):.2f}** ({min(total):.2f}-{max(total):.2f})"])
    print(f"python -m sharded_exp {' '.join(args.overrides)}; medians of {args.repeats} runs (seconds)")
    print(markdown(["phase", "seconds"], rows))
    print(f"wrote {save('startup', {'args': vars(args), 'runs': runs})}")


if __name__ == "__main__":
    main()
