"""The BERT job of benchmarks/harness/hf_trainer_vs.py under the Hugging Face Trainer (DDP, gloo, CPU).

    torchrun --standalone --nproc-per-node=2 -m benchmarks.harness.hf_trainer_job --out t.json model=hf_bert ...

The same model (built from sharded_exp's config, same seed), the same batches (the
token-classification task's, per rank), AdamW with the same learning rate, clipping and
steps, Trainer's DDP on 2 CPU processes. Writes the step times after the warm-up, the
first step's time, the loop time per step and every rank's peak RSS to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from benchmarks.harness.peer import Clock, batches, write_peer_result
from sharded_exp.compose import compose
from sharded_exp.models import build_model


def main() -> None:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = OmegaConf.create(OmegaConf.to_container(compose(args.overrides), resolve=True, enum_to_str=True))
    tc = cfg.trainer
    clock = Clock()

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.step_begins()

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_ends()

    torch.manual_seed(tc.seed)
    model = build_model(cfg.model)
    training = TrainingArguments(
        output_dir=args.out + ".trainer",
        max_steps=tc.steps,
        per_device_train_batch_size=1,  # one item of the dataset is one whole batch
        learning_rate=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay,
        max_grad_norm=tc.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=tc.seed,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=batches(cfg, tc.steps),
        data_collator=lambda items: items[0],  # the dataset yields whole batches already
        callbacks=[Timing()],
    )
    trainer.train()
    write_peer_result(args.out, clock, tc.warmup_steps, transformers.__version__)


if __name__ == "__main__":
    main()
