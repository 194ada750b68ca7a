"""Data time against step time for every shipped task at its model's default shape.

    python -m benchmarks.features.data_time                       # mlp, gpt, hf_gpt2, hf_llama, hf_bert
    python -m benchmarks.features.data_time --models gpt --steps 8   # smoke

For each model, one job (``python -m sharded_exp model=NAME``, 2 ranks, W&B off) and its
result.json: ``data_time_s_per_step`` (waiting for the prefetched batches plus their copy
to the device) against ``step_time_s_median``, both medians of the same timed steps.
Beside them, what one step's batches take to make with nothing hidden (the task called
in this process, one thread, the job's per-rank batch size): what a data bottleneck
would cost without prefetching. Target: data time <= 5% of the step for every task.
Also times the Markov chain at GPT-2 small's shape (8 x 1025 tokens, vocabulary 50257).
Prints a Markdown table and writes outputs/benchmarks/data_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.common import OUT, markdown, save
from benchmarks.limits import COMMAND_TIMEOUT_S
from sharded_exp.compose import compose
from sharded_exp.data import build_task

MODELS = ["mlp", "gpt", "hf_gpt2", "hf_llama", "hf_bert"]


def make_seconds(task, grad_accum: int, repeats: int = 5) -> float:
    task(0, 0, 0)
    t0 = time.perf_counter()
    for step in range(1, repeats + 1):
        for micro in range(grad_accum):
            task(step, micro, 0)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    points, rows = [], []
    for model in args.models:
        overrides = [f"model={model}", f"trainer.steps={args.steps}", "trainer.warmup_steps=3", "logger=none",
                     "trainer.progress_bar=false", "trainer.accelerator=cpu"]  # fmt: skip
        out = str(OUT / "data_time" / model)
        proc = subprocess.run([sys.executable, "-m", "sharded_exp", *overrides, f"hydra.run.dir={out}"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        with open(os.path.join(out, "result.json")) as f:
            throughput = json.load(f)["throughput"]
        cfg = compose(overrides)
        task = build_task(cfg.data, cfg.model, cfg.trainer.batch_size)
        point = {
            "model": model,
            "data": cfg.data.name,
            "step_time_s": throughput["step_time_s_median"],
            "data_time_s": throughput["data_time_s_per_step"],
            "make_s": make_seconds(task, cfg.trainer.grad_accum),
        }
        point["data_fraction"] = point["data_time_s"] / point["step_time_s"]
        point["make_fraction"] = point["make_s"] / point["step_time_s"]
        points.append(point)
        rows.append([model, point["data"], f"{point['step_time_s'] * 1e3:.1f}", f"{point['data_time_s'] * 1e3:.2f}",
                     f"{point['data_fraction']:.1%}", f"{point['make_s'] * 1e3:.2f}", f"{point['make_fraction']:.1%}",
                     "yes" if point["data_fraction"] <= 0.05 else "**no**"])  # fmt: skip
    print(f"2 ranks, CPU, {args.steps} steps; medians over the timed steps (ms)")
    print(markdown(["model", "data", "step", "data time", "data / step", "make, unhidden", "make / step",
                    "<= 5%"], rows))  # fmt: skip

    gpt2_shape = compose(["model=gpt2_small"])
    big = build_task(gpt2_shape.data, gpt2_shape.model, 8)
    chain_s = make_seconds(big, 1)
    print(f"\nMarkov chain at GPT-2 small's shape (8 x {gpt2_shape.model.seq_len + 1} tokens, vocabulary "
          f"{gpt2_shape.model.vocab_size}): {chain_s * 1e3:.1f} ms per micro-batch, one thread")  # fmt: skip
    print(f"wrote {save('data_time', {'args': vars(args), 'points': points, 'gpt2_small_chain_s': chain_s})}")


if __name__ == "__main__":
    main()
