"""Time from an injected fault to the job's exit, as a user would see it.

    python -m benchmarks.harness.faults                 # raise, oom, exit, hang (timeout_s=5), 3 runs each
    python -m benchmarks.harness.faults --kinds hang --timeout-s 10 --repeats 1

Each run is ``python -m sharded_exp`` in a subprocess (2 ranks, small MLP, gloo) with
``SHARDED_EXP_FAULT=rank=1,step=3,kind=K``. The fault time is the one the rank prints when
the fault fires (``exit`` prints it too, just before exiting); the exit time is when the
subprocess has exited. Prints a Markdown table, writes outputs/benchmarks/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from benchmarks.common import OUT, markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

JOB = [
    "trainer.steps=100000",
    "trainer.warmup_steps=1",
    "trainer.batch_size=8",
    "trainer.progress_bar=false",
    "logger=none",
    "model.hidden=32",
    "model.depth=2",
]


def one(kind: str, timeout_s: float, out: str) -> dict:
    env = {**os.environ, "SHARDED_EXP_FAULT": f"rank=1,step=3,kind={kind}"}
    args = [*JOB, f"trainer.timeout_s={timeout_s}", f"hydra.run.dir={out}"]
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp", *args], env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    exited = time.time()
    fired = float(re.search(r"SHARDED_EXP_FAULT: \w+ on rank 1 at step 3, time ([\d.]+)", proc.stderr).group(1))
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    return {
        "exit_code": proc.returncode,
        "seconds": exited - fired,
        "status": result["status"],
        "error": result["error"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["raise", "oom", "exit", "hang"])
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows, data = [], []
    for kind in args.kinds:
        runs = [one(kind, args.timeout_s, str(OUT / "faults" / f"{kind}_{i}")) for i in range(args.repeats)]
        times = [r["seconds"] for r in runs]
        data.append({"kind": kind, "timeout_s": args.timeout_s, "runs": runs})
        rows.append(
            [
                kind,
                f"{statistics.median(times):.1f}",
                f"{min(times):.1f}-{max(times):.1f}",
                runs[0]["exit_code"],
                runs[0]["status"],
                runs[0]["error"][:110],
            ]
        )
    print(f"fault at rank 1, step 3; trainer.timeout_s={args.timeout_s:g}; {args.repeats} runs each")
    print(markdown(["kind", "fault to exit s (median)", "range", "exit code", "status", "error"], rows))
    print(f"wrote {save('faults', data)}")


if __name__ == "__main__":
    main()
