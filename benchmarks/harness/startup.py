"""Command to first step and command to exit for the default job, with where the time goes.

    python -m benchmarks.harness.startup                 # the default job (W&B offline), 3 runs
    python -m benchmarks.harness.startup --repeats 5 logger=none
    python -m benchmarks.harness.startup --against ../before   # side by side with another checkout

Runs ``python -m sharded_exp [overrides]`` as a user does and reads the timeline that
``result.json`` keeps (Unix times: the entry point before its imports, the launch,
validation, a rank's start, its process group, model and strategy built, first step; the
peak prediction, made while the ranks start, and the tracker, started beside the first
steps, are rows of their own, not phases of the path to the first step). ``--against DIR``: each repeat also runs the job from the
checkout in DIR (say a worktree of the commit before a change), the two alternating in
order, so that a loaded machine's moments fall on both; the table then has both columns
and their ratio. Each repeat also times the floor (:data:`FLOOR`): a fresh interpreter that
imports torch and ends one Adam step, the least a torch job does before its first step; the
job's first step is said beyond it. Prints a Markdown table and writes
outputs/benchmarks/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import OUT, command_env, markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

PHASES = [
    ("python start", "command", "main"),
    ("imports (rank server starts meanwhile)", "main", "imported"),
    ("Hydra compose", "imported", "launch"),
    (
        "validate (the check, forked from the rank server once it has imported; the parent imports torch meanwhile)",
        "launch",
        "validated",
    ),
    ("start ranks (forkserver)", "validated", "rank_start"),
    ("process group", "rank_start", "process_group_ready"),
    ("model + strategy", "process_group_ready", "built"),
    ("to first step (waits for the peak prediction)", "built", "first_step"),
    ("steps, results, exit", "first_step", "exit"),
]
"""The path from the command to its exit, phase by phase (timeline keys)."""
BESIDE = [
    ("peak prediction, from the validation (the ranks start meanwhile)", "validated", "predicted"),
    ("tracker (W&B) start, from the build", "built", "logger_ready"),
]
"""Spans beside that path: the check predicts the peak while the ranks start, which wait for
it before their first step (older checkouts: before the ranks started, within the
validation); the tracker starts in a thread of its own (older checkouts: before the first
step, which then waited for it)."""

FLOOR = (
    "import time, torch, torch.distributed;"
    "m = torch.nn.Linear(64, 64); o = torch.optim.Adam(m.parameters());"
    "m(torch.randn(8, 64)).sum().backward(); o.step(); print(time.time())"
)
"""The least any torch training job does before its first step ends, in one process on the
CPU whatever the overrides ask for: import torch and torch.distributed, one Linear's forward
and backward and one Adam step (whose first call imports torch._dynamo, as DDP's forward
does). What a CPU job takes beyond it is what sharded_exp adds: its parent, the check, the
ranks' start and their process group. Timed before the jobs in even repeats, after them in
odd ones."""


def one(overrides: list[str], out: str, checkout: str | None = None, bytecode_cache: bool = True) -> dict[str, float]:
    """One job, from ``checkout``'s sharded_exp (None: this one's)."""
    env, out = command_env(bytecode_cache, checkout), os.path.abspath(out)
    if checkout is not None:  # run from there: ``-m`` puts the working directory first on the path
        env["PYTHONPATH"] = os.path.abspath(checkout)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp", *overrides, f"hydra.run.dir={out}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=checkout,
        timeout=COMMAND_TIMEOUT_S,
    )
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(out, "result.json")) as f:
        timeline = json.load(f)["timeline"]
    return {"command": t0, **timeline, "exit": exited}


def floor() -> float:
    """Seconds from the command to the end of :data:`FLOOR`'s step, in a fresh interpreter (it
    imports torch only, whose bytecode in site-packages is read whatever the job's cache)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return float(proc.stdout.split()[-1]) - t0


def medians(runs: list[dict[str, float]]) -> list[float | None]:
    """Each phase's median seconds, then the command to the first step and to the exit."""
    spans = [*PHASES, *BESIDE, ("", "command", "first_step"), ("", "command", "exit")]
    out = []
    for _, a, b in spans:
        seconds = [r[b] - r[a] for r in runs if r.get(a) is not None and r.get(b) is not None]
        out.append(statistics.median(seconds) if seconds else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", metavar="DIR", help="another checkout, run alternately with this one")
    parser.add_argument("--no-bytecode-cache", dest="bytecode_cache", action="store_false",
                        help="run as this project's machines do (PYTHONDONTWRITEBYTECODE=1), not as a user's Python")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="config overrides (default: none, the default job)")
    args = parser.parse_args()

    runs, others, floors = [], [], []
    for i in range(args.repeats):
        if i % 2 == 0:  # before the jobs in one repeat, after them in the next
            floors.append(floor())
        ours = lambda: runs.append(one(args.overrides, str(OUT / "startup" / str(i)), None, args.bytecode_cache))  # noqa: E731
        theirs = lambda: others.append(  # noqa: E731
            one(args.overrides, str(OUT / "startup" / f"against{i}"), args.against, args.bytecode_cache)
        )
        for side in (ours, theirs) if i % 2 == 0 else (theirs, ours):
            if side is ours or args.against:
                side()
        if i % 2 == 1:
            floors.append(floor())
    labels = [label for label, _, _ in PHASES + BESIDE] + ["**command to first step**", "**command to exit**"]
    cell = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    if args.against:
        theirs_m, ours_m = medians(others), medians(runs)
        ratio = lambda a, b: "" if a is None or b is None or not a else f"{b / a:.2f}"  # noqa: E731
        rows = [[lb, cell(a), cell(b), ratio(a, b)] for lb, a, b in zip(labels, theirs_m, ours_m)]
        header = ["phase", args.against, "this checkout", "this / that"]
    else:
        rows = [[lb, cell(v)] for lb, v in zip(labels, medians(runs))]
        first = [r["first_step"] - r["command"] for r in runs]
        total = [r["exit"] - r["command"] for r in runs]
        rows[-2][1] += f" ({min(first):.2f}-{max(first):.2f})"
        rows[-1][1] += f" ({min(total):.2f}-{max(total):.2f})"
        header = ["phase", "seconds"]
    cache = "on (as a user's Python)" if args.bytecode_cache else "off (PYTHONDONTWRITEBYTECODE=1)"
    print(
        f"python -m sharded_exp {' '.join(args.overrides)}; medians of {args.repeats} runs (seconds); bytecode cache {cache}"
    )
    print(markdown(header, rows))
    firsts = [r["first_step"] - r["command"] for r in runs if r.get("first_step") is not None]
    beyond = f"; this checkout's first step {statistics.median(firsts) - statistics.median(floors):.2f} s beyond it"
    print(
        f"floor (a fresh python on CPU: import torch, one Linear's step under Adam): {statistics.median(floors):.2f} s "
        f"({min(floors):.2f}-{max(floors):.2f}){beyond if firsts else ''}"
    )
    saved = {"args": vars(args), "runs": runs, "against": others, "floor_s": floors}
    print(f"wrote {save('startup', saved)}")


if __name__ == "__main__":
    main()
