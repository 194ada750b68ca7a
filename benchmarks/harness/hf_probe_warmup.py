"""Where the probe's time goes in a Hugging Face Trainer run, with and without gradient accumulation.

    python -m benchmarks.harness.hf_probe_warmup              # GPT-2 (4 x 256), batch 4 x 128 tokens, 12 steps
    python -m benchmarks.harness.hf_probe_warmup --smoke      # a smoke run: GPT-2 (2 x 64), batch 4 x 32, 8 steps

One process, four Trainer runs in turn (gradient_accumulation_steps 1 and 4, each bare and
with ``MemoryProbe``), every step timed by a callback of the benchmark's own. The probed
run's steps fall in four phases: the first (the model's first call runs the fake-step
prediction, over every micro-batch of a step), the rest of the warm-up (steps 2-5), the
tracked window (6-7: torch's MemTracker follows every tensor on CPU) and the timed steps
after it, the only ones the probe reports. The table gives each phase's median against the
bare run's same steps. Writes outputs/benchmarks/hf_probe_warmup.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import markdown, save

WARMUP, TRACKED = 5, 2  # MemoryProbe's defaults
PHASES = {"first step": slice(0, 1), "warm-up 2-5": slice(1, WARMUP), "tracked 6-7": slice(WARMUP, WARMUP + TRACKED),
          "timed 8-": slice(WARMUP + TRACKED, None)}  # fmt: skip


SHAPES = {"full": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 4096, "n_positions": 128},
          "smoke": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 32}}  # fmt: skip
"""The GPT-2 timed, and the smoke run's (the same four runs and phases, each step a fraction of the time)."""


def step_times(probed: bool, accumulation: int, steps: int, out: str, shape: dict) -> list[float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from sharded_exp.integrations.transformers import MemoryProbe

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**shape))
    tokens = torch.randint(
        0, shape["vocab_size"], (4096, shape["n_positions"]), generator=torch.Generator().manual_seed(0)
    )
    data = [{"input_ids": t, "labels": t} for t in tokens]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.t0)

    args = TrainingArguments(
        output_dir=f"{out}/trainer", max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [Clock()] + ([MemoryProbe(f"{out}/probe_{accumulation}")] if probed else [])
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 12; --smoke: 8)")
    parser.add_argument("--smoke", action="store_true", help="the smoke run's small GPT-2 (SHAPES), 8 steps")
    args = parser.parse_args()
    args.steps = args.steps or (WARMUP + TRACKED + 1 if args.smoke else 12)
    shape = SHAPES["smoke" if args.smoke else "full"]
    if args.steps < WARMUP + TRACKED + 1:
        parser.error(f"--steps={args.steps}: at least {WARMUP + TRACKED + 1} (warm-up, tracked window, one timed step)")
    rows, data = [], {}
    with tempfile.TemporaryDirectory() as out:
        for accumulation in (1, 4):
            bare = step_times(False, accumulation, args.steps, out, shape)
            probed = step_times(True, accumulation, args.steps, out, shape)
            data[accumulation] = {"bare_s": bare, "probed_s": probed}
            for phase, part in PHASES.items():
                b, p = statistics.median(bare[part]), statistics.median(probed[part])
                rows.append([accumulation, phase, f"{b:.3f}", f"{p:.3f}", f"{p / b:.2f}x"])
    print(
        markdown(["gradient_accumulation_steps", "steps", "bare s (median)", "probed s (median)", "probed/bare"], rows)
    )
    print(f"written: {save('hf_probe_warmup', data)}")


if __name__ == "__main__":
    main()
