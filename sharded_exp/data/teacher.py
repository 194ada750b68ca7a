"""teacher: Gaussian inputs labelled by the argmax of a fixed random 2-layer network."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharded_exp.config import Sealed, bounded, check_fed
from sharded_exp.data import TASKS, Batch, Task, generator


@dataclass
class TeacherConfig(Sealed):
    FEEDS = "classifiers (model=mlp)"
    MODEL_FIELDS = ("in_features", "num_classes")

    name: str = "teacher"
    seed: int = 1234
    """Seed of the task (the teacher's weights), not of the batches."""
    teacher_hidden: int = bounded(32, at_least=1)
    """Hidden width of the fixed random teacher network that labels the inputs."""


@TASKS.register("teacher", config=TeacherConfig)
def teacher_task(cfg: TeacherConfig, model_cfg, batch_size: int) -> Task:
    """Gaussian inputs labelled by the argmax of a fixed random 2-layer teacher network."""
    check_fed(cfg, model_cfg, TeacherConfig)
    g = generator(cfg.seed)
    w1 = torch.randn(model_cfg.in_features, cfg.teacher_hidden, generator=g)
    w2 = torch.randn(cfg.teacher_hidden, model_cfg.num_classes, generator=g)

    seed, in_features = cfg.seed, model_cfg.in_features  # plain ints: config lookups are slow

    def batch(step: int, micro: int, rank: int) -> Batch:
        x = torch.randn(batch_size, in_features, generator=generator(seed, step, micro, rank))
        y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
        return {"inputs": x, "targets": y}

    return Task(batch, metric="accuracy", labels="targets", num_classes=model_cfg.num_classes)
