"""What ``trainer.profile=true`` costs: trace size and step time, profiled vs unprofiled.

    python -m benchmarks.features.profile_cost                 # two models, 2 CPU ranks, 5 profiled steps each
    python -m benchmarks.features.profile_cost --smoke         # CI: one small point

Each point is one real job: the steps right after warm-up are profiled (torch.profiler,
CPU activities; CUDA's too on a GPU) and left out of the timing, the rest are timed. From
its result.json: the median profiled step beside the median timed (unprofiled) step of
the same run, the trace's size per rank and per profiled step, and the time to write it.
Prints a Markdown table, writes outputs/benchmarks/profile_cost.json.
"""

from __future__ import annotations

import argparse

from benchmarks.common import markdown, run, save

MODELS = {
    "mlp": ["model=mlp", "model.hidden=512", "model.depth=4"],
    "gpt": ["model=gpt", "model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64"],
}
SMOKE = {"mlp": ["model=mlp", "model.hidden=32", "model.depth=2"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    models = SMOKE if args.smoke else {name: MODELS[name] for name in args.models}
    if args.smoke:
        args.profile_steps, args.timed_steps = 2, 3
    warmup = 2  # the CPU memory tracker's window: never profiled, never timed
    rows, points = [], []
    for name, model in models.items():
        overrides = [*model, "strategy=ddp", "trainer.world_size=2", "logger=none", "trainer.progress_bar=false",
                     f"trainer.warmup_steps={warmup}", f"trainer.steps={warmup + args.profile_steps + args.timed_steps}",
                     "trainer.profile=true", f"trainer.profile_steps={args.profile_steps}",
                     "trainer.eval_batches=0"]  # fmt: skip
        result = run(overrides, f"profile_cost/{name}")
        p = result["profile"]
        if p["error"]:
            raise RuntimeError(f"{name}: {p['error']}")
        point = {
            "model": name,
            "params": result["params"],
            "profiled_steps": len(p["steps"]),
            "timed_steps": result["throughput"]["timed_steps"],
            "profiled_step_s": p["step_time_s_median"],
            "unprofiled_step_s": p["unprofiled_step_time_s_median"],
            "cost_ratio": p["cost_ratio"],
            "trace_mib_per_rank": p["size_mib_per_rank"],
            "trace_mib_per_step": p["size_mib_per_rank"] / len(p["steps"]),
            "export_s": p["export_s"],
            "device": result["device"]["type"],
        }
        points.append(point)
        rows.append([name, f"{point['params']:,}", point["profiled_steps"], point["timed_steps"],
                     f"{1e3 * point['profiled_step_s']:.1f}", f"{1e3 * point['unprofiled_step_s']:.1f}",
                     f"{point['cost_ratio']:.2f}x", f"{point['trace_mib_per_rank']:.2f}",
                     f"{point['trace_mib_per_step']:.2f}", f"{point['export_s']:.2f}"])  # fmt: skip
    header = ["model", "params", "profiled steps", "timed steps", "profiled step ms", "unprofiled step ms",
              "cost", "trace MiB/rank", "trace MiB/step", "export s"]  # fmt: skip
    print(markdown(header, rows))
    print(f"wrote {save('profile_cost', {'points': points, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
