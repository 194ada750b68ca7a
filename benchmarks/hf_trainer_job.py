"""The BERT job of benchmarks/hf_trainer_vs.py under the Hugging Face Trainer (DDP, gloo, CPU).

    torchrun --standalone --nproc-per-node=2 -m benchmarks.hf_trainer_job --out t.json model=hf_bert ...

The same model (built from sharded_exp's config, same seed), the same batches (the
token-classification task's, per rank), AdamW with the same learning rate, clipping and
steps, Trainer's DDP on 2 CPU processes. Writes the step times after the warm-up, the
first step's time, the loop time per step and every rank's peak RSS to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.data import IterableDataset

from benchmarks.common import compose_cfg
from sharded_exp.data import build_task
from sharded_exp.models import build_model


class Batches(IterableDataset):
    """The harness's deterministic batches for (step, micro-batch 0, this rank)."""

    def __init__(self, cfg, steps: int):
        self.cfg, self.steps = cfg, steps

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        task = build_task(self.cfg.data, self.cfg.model, self.cfg.trainer.batch_size)
        for step in range(self.steps):
            yield task(step, 0, rank)


def main() -> None:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = OmegaConf.create(OmegaConf.to_container(compose_cfg(args.overrides), resolve=True, enum_to_str=True))
    tc = cfg.trainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.first_step_unix: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.first_step_unix is None:
                self.first_step_unix = time.time()
            self.starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    torch.manual_seed(tc.seed)
    model = build_model(cfg.model)
    training = TrainingArguments(
        output_dir=args.out + ".trainer",
        max_steps=tc.steps,
        per_device_train_batch_size=tc.batch_size,
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
    clock = Clock()

    class Collate:
        def __call__(self, items):  # the dataset yields whole batches already
            return items[0]

    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Batches(cfg, tc.steps),
        data_collator=Collate(),
        callbacks=[clock],
    )
    trainer.args.per_device_train_batch_size = 1  # one item of the dataset is one batch
    trainer.train()
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if dist.get_rank() == 0:
        warm = tc.warmup_steps
        steps = [end - start for start, end in zip(clock.starts, clock.ends)][warm:]
        with open(args.out, "w") as f:
            json.dump(
                {
                    "first_step_unix": clock.first_step_unix,
                    "step_time_s": steps,
                    "loop_time_s_per_step": (clock.ends[-1] - clock.starts[warm]) / (len(clock.ends) - warm),
                    "peak_rss_mib": rss,
                    "version": transformers.__version__,
                },
                f,
            )


if __name__ == "__main__":
    main()
