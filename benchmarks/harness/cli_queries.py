"""How long Hydra's questions take: ``--help``, ``--cfg job``, ``-sc query=bash``, of the
trainer (``sharded-exp``) and of the planner (``sharded-exp-plan``).

    python -m benchmarks.harness.cli_queries               # 3 runs of each, side by side
    python -m benchmarks.harness.cli_queries --repeats 5

Each is run as a user does (``sharded-exp`` from the venv, else ``python -m sharded_exp``)
from an empty directory, next to ``python -c 'import torch'`` and
``python -c 'import hydra'`` in the same loop, so the figures share the machine's load.
None of these questions starts a rank or the rank server; they still compose the config,
whose typed schemas sit beside builders that import torch. Writes
outputs/benchmarks/cli_queries.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S


def commands() -> dict[str, list[str]]:
    exe = shutil.which("sharded-exp", path=os.path.dirname(sys.executable)) or ""
    job = [exe] if exe else [sys.executable, "-m", "sharded_exp"]
    planner = shutil.which("sharded-exp-plan", path=os.path.dirname(sys.executable)) or ""
    plan = [planner] if planner else [sys.executable, "-m", "sharded_exp.plan"]
    return {
        "import hydra (floor)": [sys.executable, "-c", "import hydra"],
        "import torch (floor)": [sys.executable, "-c", "import torch"],
        "--help": [*job, "--help"],
        "--cfg job": [*job, "--cfg", "job"],
        "-sc query=bash": [*job, "-sc", "query=bash"],
        "sharded-exp-plan --help": [*plan, "--help"],
        "sharded-exp-plan --cfg job": [*plan, "--cfg", "job", "model=gpt_7b"],
        "sharded-exp-plan --info defaults": [*plan, "--info", "defaults"],
        "sharded-exp-plan -sc query=bash": [*plan, "-sc", "query=bash"],
    }


def timed(cmd: list[str], cwd: str) -> float:
    env = {**os.environ, "COMP_LINE": "sharded-exp strat", "COMP_POINT": "17"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cmds = commands()
    times: dict[str, list[float]] = {name: [] for name in cmds}
    with tempfile.TemporaryDirectory() as empty:
        for _ in range(args.repeats):  # interleaved: every command sees the same load
            for name, cmd in cmds.items():
                times[name].append(timed(cmd, empty))
        leftovers = os.listdir(empty)
    rows = [[name, f"{statistics.median(t):.2f}", f"{min(t):.2f}-{max(t):.2f}"] for name, t in times.items()]
    print(markdown(["command", "median s", "range s"], rows))
    print(f"files left in the empty directory: {leftovers or 'none'}")
    print("saved", save("cli_queries", {"seconds": times, "commands": cmds, "leftovers": leftovers}))


if __name__ == "__main__":
    main()
