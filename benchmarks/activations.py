"""Transformer activation memory: the planner's prediction vs a CPU measurement.

    python -m benchmarks.activations

One forward + backward per shape under torch's MemTracker (peak Activation + Temp, fp32,
one process), next to ``sharded_exp.measure.prediction.activation_bytes``. Prints a Markdown table.
"""

from __future__ import annotations

from benchmarks.common import markdown
from sharded_exp.measure.prediction import activation_bytes
from sharded_exp.measure.tracker import gpt_activation_mib
from sharded_exp.models.gpt import GPTConfig

SHAPES = [(4, 64, 128, 2, 4, 256), (8, 32, 64, 3, 4, 512), (2, 128, 256, 2, 8, 256), (8, 64, 64, 4, 2, 1024),
          (4, 128, 128, 6, 4, 512)]  # fmt: skip


def measure(b, s, d, layers, heads, vocab) -> tuple[float, float]:
    """(predicted, measured) activation MiB of one fp32 forward + backward."""
    cfg = GPTConfig(vocab_size=vocab, seq_len=s, d_model=d, n_layers=layers, n_heads=heads)
    return activation_bytes(cfg, b, "32") / 2**20, gpt_activation_mib(cfg, b)


def main() -> None:
    rows = []
    for shape in SHAPES:
        predicted, measured = measure(*shape)
        rows.append([*shape, f"{predicted:.2f}", f"{measured:.2f}", f"{100 * (predicted / measured - 1):+.1f}%"])
    print(
        markdown(
            ["batch", "seq_len", "d_model", "n_layers", "n_heads", "vocab", "predicted_MiB", "measured_MiB", "error"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
