"""How fast the planner answers, beside ``import torch`` measured in the same run.

    python -m benchmarks.harness.planner_speed            # both targets and the agreement check
    python -m benchmarks.harness.planner_speed --quick    # the 7B plan only
    python -m benchmarks.harness.planner_speed --time-model-cost   # the 7B plan with and without speed columns
    python -m benchmarks.harness.planner_speed --allocator-cost    # ... with and without the allocator model

Each plan runs as a user runs it (``python -m sharded_exp.plan ... plan.format=json``, a
fresh process), with its wall time and peak resident memory; ``import torch`` alone is
timed the same way, just before, so a loaded machine slows both. Targets on a 2-core
machine: a 7B GPT, six strategies x [8,64], within 20 s; a 65B-class GPT (80 layers,
d_model 8192, 64 heads, bf16), six strategies x [8,16,32,64], within 60 s; under 2 GiB
of RSS (``plan.workers``, by default one per core, fakes strategies side by side; the
65B-class plan in one process, ``plan.workers=1``, shows what one process holds doing all
of it). Then the composed plans (sharded_exp/plan/depth.py) are held against whole-model
fake steps on models that can be faked whole: the largest relative difference of the peak
and of the mean over ranks. Prints Markdown; writes outputs/benchmarks/planner_speed.json.

``--time-model-cost`` answers issue 49's budget (the time model adds at most 20% to a 7B
plan's wall time): the 7B plan as a user runs it, alternately as it is and with the speed
columns' traced step left out, ``--rounds`` times each, at the same commit. The traced step
is left out by a ``sitecustomize`` on ``PYTHONPATH`` (written to a temporary directory) that
replaces ``sharded_exp.plan.points.traced`` in every process, the planner's forkserver
workers included: nothing in the planner knows about the benchmark. The side with the time
model runs a ``sitecustomize`` that imports the same and replaces nothing, so both pay alike.

``--allocator-cost`` answers issue 47's (the allocator model adds at most 10% to a 7B plan's
wall time) the same way (each side's fake steps' CPU seconds, summed over the plan's rows, are
printed beside: where the wall time went): the side without it records no allocation trace in any fake step
(``sharded_exp.predict.fake_step.recording`` yields None, as for a CPU plan), so nothing is
replayed, no trace is drawn to depth, and no fake is made for the allocator's checks alone;
its rows have no reserved memory. Everything else, the speed columns among it, is on both sides.
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

from benchmarks.common import markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S

PLANS = {
    "7B GPT, six strategies x [8,64]": (
        ["model=gpt_7b", "trainer.batch_size=1", "plan.world_sizes=[8,64]"], 20.0),
    "65B-class GPT (80 x 8192, 64 heads, bf16), six strategies x [8,16,32,64]": (
        ["model=gpt_7b", "model.n_layers=80", "model.d_model=8192", "model.n_heads=64", "precision=bf16",
         "trainer.batch_size=1", "plan.world_sizes=[8,16,32,64]"], 60.0),
    "the same 65B-class plan in one process (plan.workers=1)": (
        ["model=gpt_7b", "model.n_layers=80", "model.d_model=8192", "model.n_heads=64", "precision=bf16",
         "trainer.batch_size=1", "plan.world_sizes=[8,16,32,64]", "plan.workers=1"], 60.0),
}  # fmt: skip
AGREEMENT = {
    "the 8-block model of the scale tests": ["model=gpt", "model.d_model=128", "model.n_heads=4", "model.n_layers=8",
                                             "model.seq_len=8", "model.vocab_size=64", "trainer.batch_size=2"],
    "a 7B-wide GPT cut to 8 blocks": ["model=gpt_7b", "model.n_layers=8", "trainer.batch_size=1"],
}  # fmt: skip
RUN = (
    "import resource, sys, time; t = time.perf_counter(); from sharded_exp.plan.command import main; "
    "code = main(sys.argv[1:]); "
    "rss = max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)); "
    "print('BENCH', time.perf_counter() - t, rss, file=sys.stderr); "
    "sys.exit(code)"
)


def import_torch_seconds() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=COMMAND_TIMEOUT_S)
    return time.perf_counter() - t


def plan_once(args: list[str], env: dict[str, str] | None = None) -> dict:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *args, "plan.format=json"],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=env,
    )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stderr.splitlines() if x.startswith("BENCH "))
    rss_kib = int(line.split()[2])
    doc = json.loads(proc.stdout)
    return {"wall_s": wall, "peak_rss_mib": rss_kib / 1024, "points": len(doc["rows"]),
            "composed": sum(r["method"].startswith("composed") for r in doc["rows"]), "rows": doc["rows"]}  # fmt: skip


SMOKE = ["model=gpt", "model.d_model=128", "model.n_heads=4", "model.n_layers=8", "model.seq_len=8",
         "model.vocab_size=64", "trainer.batch_size=2", "plan.strategies=[ddp,fsdp]"]  # fmt: skip
"""``--smoke``: the 8-block model, two strategies (tests/integration/test_benchmarks.py)."""

SMOKE_ONE_POINT = [
    *[o for o in SMOKE if not o.startswith("plan.strategies=")],
    "plan.strategies=[ddp]",
    "plan.world_sizes=[2]",
]
"""``--time-model-cost --smoke`` (or ``--allocator-cost``): one point of the 8-block model,
enough to show that both kinds of plan ran and only one has the part's column (each kind is a
whole plan: the smoke's four points took about a minute on 2 cores)."""


def agreement(overrides: list[str]) -> dict:
    """The composed plan beside the whole model faked, in this process (one composition
    over both world sizes: the first checks the lines, the second reuses or redraws them)."""
    from sharded_exp.compose import compose
    from sharded_exp.plan import points

    cfg = compose([*overrides, "plan.world_sizes=[2,8]"], "plan")
    t = time.perf_counter()
    composed = points.plan_rows(cfg, [2, 8], "cuda")
    t_composed = time.perf_counter() - t
    cfg.plan.by_depth = False
    t = time.perf_counter()
    whole = points.plan_rows(cfg, [2, 8], "cuda")
    t_whole = time.perf_counter() - t
    diff = lambda k: max(abs(c[k] - w[k]) / w[k] for c, w in zip(composed, whole))  # noqa: E731
    return {"peak": diff("total_gib"), "mean": diff("mean_gib"), "composed_s": t_composed, "whole_s": t_whole,
            "composed_points": sum(r["method"].startswith("composed") for r in composed), "points": len(composed)}  # fmt: skip


SITECUSTOMIZE = """\
import contextlib
from sharded_exp.plan import points
from sharded_exp.predict import fake_step
if {stub} == "time model":
    points.traced = lambda *a, **k: {{"error": "speed columns left out (benchmarks.harness.planner_speed)"}}
elif {stub} == "allocator model":
    fake_step.recording = lambda *a, **k: contextlib.nullcontext(None)
"""
"""The cost benchmarks' ``sitecustomize``: every new interpreter of either side imports the
planner (the stub's import, paid alike by both sides: multiprocessing's resource tracker is
such an interpreter); only the side without the part measured (``stub``) replaces it."""

LEFT_OUT = {"time model": "step_time_s", "allocator model": "reserved_gib"}
"""Each part whose cost is measured, and the plan column only it fills."""


def part_cost(part: str, rounds: int, overrides: list[str]) -> dict:
    """A plan (the 7B one) with and without ``part`` (a key of :data:`LEFT_OUT`), alternating;
    wall seconds of each."""
    column = LEFT_OUT[part]
    with tempfile.TemporaryDirectory() as tmp:
        envs = {}
        for kind, stub in (("with", ""), ("without", part)):
            os.makedirs(os.path.join(tmp, kind))
            with open(os.path.join(tmp, kind, "sitecustomize.py"), "w") as f:
                f.write(SITECUSTOMIZE.format(stub=repr(stub)))
            path = os.pathsep.join(x for x in (os.getcwd(), os.path.join(tmp, kind), os.environ.get("PYTHONPATH")) if x)
            envs[kind] = {**os.environ, "PYTHONPATH": path}
        walls: dict[str, list[float]] = {"with": [], "without": []}
        fakes: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(rounds):
            for kind, env in envs.items():
                got = plan_once(overrides, env)
                figures = [r.get(column) for r in got["rows"]]
                filled = [v is not None for v in figures]
                if not (all(filled) if kind == "with" else not any(filled)):  # the stub took, everywhere, only there
                    raise RuntimeError(f"plan {kind} the {part} has {column} {figures}")
                walls[kind].append(got["wall_s"])
                fakes[kind].append(sum(r.get("seconds") or 0.0 for r in got["rows"]))
    mean = {k: statistics.mean(v) for k, v in walls.items()}
    return {"part": part, "walls_s": walls, "mean_s": mean, "cost_pct": 100 * (mean["with"] / mean["without"] - 1),
            "fake_step_s": fakes}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 7B plan only, no agreement check")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a small model, two strategies (one point with a cost flag): that the script runs",
    )
    parser.add_argument(
        "--time-model-cost",
        action="store_true",
        help="the 7B plan with and without the speed columns, alternating (issue 49's 20%% budget)",
    )
    parser.add_argument(
        "--allocator-cost",
        action="store_true",
        help="the 7B plan with and without the CUDA allocator model, alternating (issue 47's 10%% budget)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--time-model-cost, --allocator-cost: plans of each kind")
    args = parser.parse_args()
    part, budget = (
        ("time model", 20) if args.time_model_cost else ("allocator model", 10) if args.allocator_cost else ("", 0)
    )
    if part:
        plan = SMOKE_ONE_POINT if args.smoke else PLANS["7B GPT, six strategies x [8,64]"][0]
        cost = part_cost(part, args.rounds, plan)
        print(markdown(["plan: " + ("smoke" if args.smoke else "7B GPT, six strategies x [8,64]"), "wall s each",
                        "mean s"],
                       [[k, ", ".join(f"{w:.1f}" for w in v), f"{cost['mean_s'][k]:.1f}"]
                        for k, v in cost["walls_s"].items()]))  # fmt: skip
        print(f"\nthe {part} adds {cost['cost_pct']:+.1f}% (target: at most +{budget}%)")
        print("the points' fake steps, CPU s summed over rows: "
              + "; ".join(f"{k} {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in cost["fake_step_s"].items()))  # fmt: skip
        print(f"written: {save('planner_speed', {part.replace(' ', '_') + '_cost': cost})}")
        return 0
    plans = dict(list(PLANS.items())[:1]) if args.quick else PLANS
    agreements = AGREEMENT
    if args.smoke:
        plans = {"smoke: the 8-block model, ddp and fsdp x [2,8]": ([*SMOKE, "plan.world_sizes=[2,8]"], 600.0)}
        agreements = {"smoke: the 8-block model, ddp and fsdp": SMOKE}
    rows, out = [], {"plans": {}, "agreement": {}}
    for name, (overrides, target) in plans.items():
        torch_s = import_torch_seconds()
        got = plan_once(overrides)
        out["plans"][name] = {
            "import_torch_s": torch_s,
            "target_s": target,
            **{k: v for k, v in got.items() if k != "rows"},
        }
        rows.append([name, f"{got['wall_s']:.1f}", f"{torch_s:.1f}", f"{got['wall_s'] / torch_s:.1f}", f"{target:g}",
                     "yes" if got["wall_s"] <= target else "no", f"{got['peak_rss_mib']:.0f}",
                     f"{got['composed']}/{got['points']}"])  # fmt: skip
    print(markdown(["plan", "wall s", "import torch s", "x import torch", "target s", "within", "peak RSS MiB",
                    "composed points"], rows))  # fmt: skip
    if not args.quick:
        agree = []
        for name, overrides in agreements.items():
            a = agreement(overrides)
            out["agreement"][name] = a
            agree.append([name, f"{a['peak']:.2e}", f"{a['mean']:.2e}", f"{a['composed_points']}/{a['points']}",
                          f"{a['composed_s']:.1f}", f"{a['whole_s']:.1f}"])  # fmt: skip
        print()
        print(markdown(["composed vs whole (x [2,8], cuda)", "peak: largest rel. diff", "mean: largest",
                        "composed points", "composed s", "whole s"], agree))  # fmt: skip
    print(f"\nwritten: {save('planner_speed', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
