"""What recording the CUDA allocator's history costs a step (``trainer.memory_snapshot``).

    python -m benchmarks.features.memory_history_cost              # on a GPU: 3 pairs of jobs, GPT 512x8 bf16
    python -m benchmarks.features.memory_history_cost --quick      # fewer steps (also the device check's)

Pairs of real jobs at world size 1, the same but for ``trainer.memory_snapshot``: ``off``
(nothing recorded) and ``always`` (the history recorded over the whole run, as ``oom``
records it, and dumped once after the last step, outside the timed steps). The median
step time of each, their ratio, and the snapshot file's size. Without CUDA there is
nothing to record: the figures are null and the reason is said. Prints a Markdown table,
writes outputs/benchmarks/memory_history_cost.json.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.common import markdown, run, save

MODEL = ["model=gpt", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.seq_len=256",
         "precision=bf16", "trainer.batch_size=8"]  # fmt: skip
NO_CUDA = "no CUDA device here: the allocator's history is recorded on CUDA only (CPU runs record nothing)"


def measure(pairs: int, steps: int, model: list[str] = MODEL) -> dict:
    """``pairs`` pairs of jobs (off, then always); the figures, or null and the reason."""
    if not torch.cuda.is_available():
        return {"cost_ratio": None, "reason": NO_CUDA, "pairs": []}
    common = [*model, "strategy=ddp", "trainer.world_size=1", "trainer.accelerator=gpu", f"trainer.steps={steps}",
              "trainer.warmup_steps=3", "trainer.eval_batches=0", "logger=none", "trainer.progress_bar=false"]  # fmt: skip
    out = []
    for i in range(pairs):
        off = run([*common, "trainer.memory_snapshot=off"], f"memory_history_cost/{i}_off")
        on = run([*common, "trainer.memory_snapshot=always"], f"memory_history_cost/{i}_on")
        snapshot = on["memory"]["memory_snapshot"]
        files = snapshot["files"]
        out.append({
            "off_step_s": off["throughput"]["step_time_s_median"],
            "on_step_s": on["throughput"]["step_time_s_median"],
            "recorded": snapshot["recorded"],
            "snapshot_mib": os.path.getsize(files[0]) / 2**20 if files else None,
            "reason": snapshot["reason"],
        })  # fmt: skip
    ratio = statistics.median(p["on_step_s"] / p["off_step_s"] for p in out)
    recorded = all(p["recorded"] for p in out)
    return {"cost_ratio": ratio if recorded else None, "reason": None if recorded else out[0]["reason"], "pairs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps = 1, 12
    data = measure(args.pairs, args.steps)
    rows = [[i, f"{1e3 * p['off_step_s']:.2f}", f"{1e3 * p['on_step_s']:.2f}", f"{p['on_step_s'] / p['off_step_s']:.3f}",
             "-" if p["snapshot_mib"] is None else f"{p['snapshot_mib']:.1f}"] for i, p in enumerate(data["pairs"])]  # fmt: skip
    if not rows:
        rows = [["-", "-", "-", "null", f"- ({data['reason']})"]]
    print(markdown(["pair", "step ms, off", "step ms, recording", "ratio", "snapshot MiB"], rows))
    ratio = data["cost_ratio"]
    print(f"cost: {'null (' + data['reason'] + ')' if ratio is None else f'{ratio:.3f}x a step (median of pairs)'}")
    print(f"wrote {save('memory_history_cost', {**data, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
