"""Model-state memory per rank: measured vs predicted, and the saving vs DDP.

    python -m benchmarks.accuracy.memory_table                      # GPT, Adam, fp32, world size 2 and 4
    python -m benchmarks.accuracy.memory_table --world-sizes 2 --strategies ddp oss

One run per (strategy, world size), all in this one invocation. Measured = the real
tensors a rank holds after a step (parameters, gradients, optimizer state); peak = live
tensors at the peak of the tracked steps (CPU: torch MemTracker; CUDA: the allocator).
Prints a Markdown table and writes outputs/benchmarks/memory_table.json.
"""

from __future__ import annotations

import argparse

from benchmarks.common import markdown, run, save, strategy_names

MODEL = ["model=gpt", "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64"]
JOB = [
    "optimizer=adam",
    "precision=32",
    "trainer.steps=4",
    "trainer.warmup_steps=2",
    "trainer.batch_size=4",
    "trainer.progress_bar=false",
    "logger=none",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=strategy_names())
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    args = parser.parse_args()

    rows, data = [], []
    for ws in args.world_sizes:
        base = None
        for strategy in args.strategies:
            r = run([f"strategy={strategy}", f"trainer.world_size={ws}", *MODEL, *JOB], f"memory_{strategy}_ws{ws}")
            mem = r["memory"]
            states = mem["model_states_mib_max"]
            opt = max(e["model_states_mib"]["optimizer"] for e in mem["per_rank"])
            if strategy == "ddp":
                base = (states, mem["peak_allocated_mib_max"])
            saving = f"{100 * (1 - states / base[0]):.1f}%" if base else "-"
            peak_saving = f"{100 * (1 - mem['peak_allocated_mib_max'] / base[1]):.1f}%" if base else "-"
            rows.append(
                [
                    strategy,
                    ws,
                    f"{r['params']:,}",
                    f"{states:.2f}",
                    f"{mem['predicted_model_states_mib_max']:.2f}",
                    f"{100 * mem['model_states_rel_error_max']:.2f}%",
                    f"{opt:.2f}",
                    saving,
                    f"{mem['peak_allocated_mib_max']:.2f}",
                    peak_saving,
                ]
            )
            data.append({"strategy": strategy, "world_size": ws, "params": r["params"], "memory": mem})
    header = [
        "strategy",
        "world_size",
        "params",
        "model_states_MiB",
        "predicted_MiB",
        "pred_error",
        "optimizer_MiB",
        "states_saving_vs_ddp",
        "peak_MiB",
        "peak_saving_vs_ddp",
    ]
    print(markdown(header, rows))
    print(f"\nsource: {data[0]['memory']['source']}; JSON: {save('memory_table', data)}")


if __name__ == "__main__":
    main()
