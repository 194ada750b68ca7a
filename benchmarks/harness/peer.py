"""Side by side with the tool a user would run instead: shared by lightning_vs and hf_trainer_vs.

Both jobs are started from the command line as a user would, alternately, ``repeats`` times
each; measured per run: the median step time after the warm-up, the loop time per step
(whole iterations), command to first step, command to exit, and the largest peak RSS over
ranks. The table shows medians and the ratio ours / theirs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from benchmarks.common import OUT, markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

KEYS = [
    ("step_time_s_median", "ms", 1e3),
    ("loop_time_s_per_step", "ms", 1e3),
    ("to_first_step_s", "s", 1),
    ("to_exit_s", "s", 1),
    ("peak_rss_mib_max", "MiB", 1),
]


def parse(description: str, job: list[str], steps: int) -> tuple:
    """The command line both comparisons share: (args, the job's overrides)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few steps, one run each (CI)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    return args, [*job, f"trainer.steps={args.steps}", f"trainer.warmup_steps={args.warmup}", *args.overrides]


def run_ours(overrides: list[str], out: str) -> dict:
    """``python -m sharded_exp``, without the evaluation pass (the peers run none)."""
    overrides = [*overrides, "trainer.eval_batches=0"]
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "sharded_exp",
        *overrides,
        "logger=none",
        "trainer.progress_bar=false",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
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


def run_peer(cmd: list[str], out_json: str) -> dict:
    """A peer job that writes ``first_step_unix``, ``step_time_s`` (timed steps),
    ``loop_time_s_per_step``, ``peak_rss_mib`` (per rank) and ``version`` to ``out_json``."""
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(out_json) as f:
        data = json.load(f)
    return {
        "step_time_s_median": statistics.median(data["step_time_s"]),
        "loop_time_s_per_step": data["loop_time_s_per_step"],
        "to_first_step_s": data["first_step_unix"] - t0,
        "to_exit_s": wall,
        "peak_rss_mib_max": max(data["peak_rss_mib"]),
        "version": data["version"],
    }


def compare(
    name: str, peer: str, ours: Callable[[str], dict], theirs: Callable[[str], dict], repeats: int, title: str, args
) -> None:
    """Alternate ``ours(out_dir)`` and ``theirs(out_dir)``; print the table, save ``name``.json."""
    runs: dict[str, list[dict]] = {"sharded_exp": [], peer: []}
    for i in range(repeats):
        order = ("sharded_exp", peer) if i % 2 == 0 else (peer, "sharded_exp")
        for who in order:
            out = str(OUT / name / f"{who}_{i}")
            runs[who].append(ours(out) if who == "sharded_exp" else theirs(out))
    med = {who: {k: statistics.median(r[k] for r in rs) for k, _, _ in KEYS} for who, rs in runs.items()}
    rows = []
    for key, unit, scale in KEYS:
        a, b = med["sharded_exp"][key], med[peer][key]
        rows.append([f"{key} ({unit})", f"{a * scale:.2f}", f"{b * scale:.2f}", f"{a / b:.3f}"])
    print(f"{title}; medians of {repeats} alternating runs each; {peer} {runs[peer][0]['version']}")
    print(markdown(["measure", "sharded_exp", peer, "ratio"], rows))
    step_ok = med["sharded_exp"]["step_time_s_median"] <= med[peer]["step_time_s_median"]
    start_ok = med["sharded_exp"]["to_first_step_s"] < med[peer]["to_first_step_s"]
    print(
        f"step time no worse than {peer}'s: {'yes' if step_ok else 'no'}; "
        f"shorter command to first step: {'yes' if start_ok else 'no'}"
    )
    print(f"wrote {save(name, {'args': vars(args), 'runs': runs, 'medians': med})}")


# ------------------------------------------------------------ inside a peer's rank
class Clock:
    """Wall time at the start and end of every step, and the first step's Unix time."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.first_step_unix: float | None = None

    def step_begins(self) -> None:
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        self.starts.append(time.perf_counter())

    def step_ends(self) -> None:
        self.ends.append(time.perf_counter())


def batches(cfg, steps: int):
    """The harness's deterministic batches for (step, micro-batch 0, this rank), as a torch dataset."""
    import torch.distributed as dist
    from torch.utils.data import IterableDataset

    from sharded_exp.data import build_task

    class Batches(IterableDataset):
        def __iter__(self):
            rank = dist.get_rank() if dist.is_initialized() else 0
            task = build_task(cfg.data, cfg.model, cfg.trainer.batch_size)
            for step in range(steps):
                yield task(step, 0, rank)

    return Batches()


def write_peer_result(path: str, clock: Clock, warmup: int, version: str) -> None:
    """Collective: every rank's peak RSS to rank 0, which writes what :func:`run_peer` reads."""
    import resource

    import torch.distributed as dist

    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if dist.get_rank() != 0:
        return
    steps = [end - start for start, end in zip(clock.starts, clock.ends)][warmup:]
    loop = (clock.ends[-1] - clock.starts[warmup]) / (len(clock.ends) - warmup)
    with open(path, "w") as f:
        json.dump(
            {"first_step_unix": clock.first_step_unix, "step_time_s": steps, "loop_time_s_per_step": loop,
             "peak_rss_mib": rss, "version": version},
            f,
        )  # fmt: skip
