"""Transformer activation memory: the planner's prediction vs a CPU measurement.

    python -m benchmarks.activations

One forward + backward per shape under torch's MemTracker (peak Activation + Temp, fp32,
one process), next to ``sharded_exp.plan.activation_bytes``. Prints a Markdown table.
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from benchmarks.common import markdown
from sharded_exp.models.gpt import GPT, GPTConfig
from sharded_exp.plan import activation_bytes

SHAPES = [(4, 64, 128, 2, 4, 256), (8, 32, 64, 3, 4, 512), (2, 128, 256, 2, 8, 256), (8, 64, 64, 4, 2, 1024),
          (4, 128, 128, 6, 4, 512)]  # fmt: skip


def measure(b, s, d, layers, heads, vocab) -> tuple[int, int]:
    cfg = GPTConfig(vocab_size=vocab, seq_len=s, d_model=d, n_layers=layers, n_heads=heads)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids, targets = torch.randint(vocab, (b, s)), torch.randint(vocab, (b, s))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(input_ids=ids, targets=targets).loss.backward()
    peak = {
        str(getattr(k, "value", k)): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    return activation_bytes(cfg, b, "32"), peak["Activation"] + peak["Temp"]


def main() -> None:
    rows = []
    for shape in SHAPES:
        predicted, measured = measure(*shape)
        rows.append(
            [*shape, f"{predicted / 2**20:.2f}", f"{measured / 2**20:.2f}", f"{100 * (predicted / measured - 1):+.1f}%"]
        )
    print(
        markdown(
            ["batch", "seq_len", "d_model", "n_layers", "n_heads", "vocab", "predicted_MiB", "measured_MiB", "error"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
