"""A Hugging Face ``Trainer`` script, measured by sharded_exp's callback: 2 CPU processes (gloo).

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_probe.py
    sharded-exp-report outputs/probe_hf

The model is a small GPT-2 built from its config class (random weights: nothing is
downloaded), the data random token ids; the Trainer is an ordinary one with one callback,
which writes outputs/probe_hf/<strategy>/result.json when training ends.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sharded_exp.integrations.transformers import MemoryProbe


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None, callbacks: list = ()) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--gpu", action="store_true", help="train on the GPUs (NCCL) instead of the CPU (gloo)")
    args = ap.parse_args(argv)

    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=2048,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    out = args.run_dir or os.path.join("outputs", "probe_hf", "ddp" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else "single")
    training = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3, logging_steps=10, save_strategy="no", report_to=[], use_cpu=not args.gpu,
        ddp_backend=None if args.gpu else "gloo", dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    probe = MemoryProbe(out)
    Trainer(model=model, args=training, train_dataset=Tokens(args.steps * args.batch_size * 2, 64, 2048),
            callbacks=[probe, *callbacks]).train()  # fmt: skip
    if probe.result is not None:
        print(f"result: {out}/result.json")


if __name__ == "__main__":
    main()
