"""Host memory a checkpoint save costs each rank, as the optimizer state grows.

    python -m benchmarks.features.checkpoint_memory                  # oss and fsdp, two model sizes, both formats
    python -m benchmarks.features.checkpoint_memory --smoke          # CI: one small point

Runs real jobs (2 CPU ranks, Adam) that save one checkpoint at the end and reads each
rank's ``checkpoint_rss_growth_mib`` from result.json: the host memory the save added at
its peak (Linux: the kernel's high-water mark reset before the save, read after it). The
consolidated format gathers to rank 0 one tensor at a time, so rank 1's cost should not
grow with the optimizer state; rank 0 holds the full state by design of that format. dcp
writes each rank's own shards. Prints a Markdown table, writes outputs/benchmarks/checkpoint_memory.json.
"""

from __future__ import annotations

import argparse

from benchmarks.common import markdown, run, save

# Same widths (the same largest tensor), 4x the layers: 4x the optimizer state.
SIZES = {"2 layers": ["model.hidden=2048", "model.depth=2"], "8 layers": ["model.hidden=2048", "model.depth=8"]}
SMOKE = {"small": ["model.hidden=256", "model.depth=2"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Two strategies, not the registry's list: one whose optimizer state is sharded by
    # fairscale (oss) and one that shards everything (fsdp), each a full set of jobs per size.
    parser.add_argument("--strategies", nargs="+", default=["oss", "fsdp"])
    parser.add_argument("--formats", nargs="+", default=["consolidated", "dcp"])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else SIZES
    if args.smoke:
        args.strategies, args.formats = args.strategies[:1], args.formats[:1]
    rows, data = [], []
    for strategy in args.strategies:
        for fmt in args.formats:
            for size, model in sizes.items():
                overrides = [
                    f"strategy={strategy}",
                    *model,
                    "logger=none",
                    "trainer.progress_bar=false",
                    "trainer.steps=3",
                    "trainer.warmup_steps=1",
                    "trainer.checkpoint_every=3",
                    f"trainer.checkpoint_format={fmt}",
                ]
                result = run(overrides, f"checkpoint_memory/{strategy}_{fmt}_{size}")
                ranks = result["memory"]["per_rank"]
                optimizer_full = sum(r["model_states_mib"]["optimizer"] for r in ranks) if strategy != "ddp" else 0
                point = {
                    "strategy": strategy,
                    "format": fmt,
                    "size": size,
                    "params": result["params"],
                    "optimizer_state_mib": optimizer_full,
                    "save_rss_mib": [r["checkpoint_rss_growth_mib"] for r in ranks],
                }
                data.append(point)
                rows.append(
                    [strategy, fmt, f"{result['params']:,}", f"{optimizer_full:.1f}"]
                    + [f"{m:.1f}" for m in point["save_rss_mib"]]
                )
    print("host memory a save added at its peak, per rank (MiB); optimizer state: all ranks together")
    print(markdown(["strategy", "format", "params", "optimizer_state_MiB", "rank0_save_MiB", "rank1_save_MiB"], rows))
    print(f"wrote {save('checkpoint_memory', data)}")


if __name__ == "__main__":
    main()
