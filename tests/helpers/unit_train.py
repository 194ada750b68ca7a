"""Small stand-ins for the train package's unit tests: a tiny classifier under the base
Strategy (no wrapper, world size 1), a task that makes its batches, recording components."""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo  # noqa: F401 -- the first optimizer imports it: here, at collection, not in a test
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.data import Task
from sharded_exp.strategies.base import Strategy

FEATURES, CLASSES = 4, 3


class TinyClassifier(nn.Module):
    """A linear classifier keeping the model contract: keyword batch in, loss and logits out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, inputs, targets):
        logits = self.fc(inputs)
        return {"loss": F.cross_entropy(logits, targets), "logits": logits}


class PlainStrategy(Strategy):
    """The base Strategy around a bare module; ``no_sync`` entries are counted, and
    ``in_no_sync`` says whether one is open."""

    def __init__(self, module: nn.Module, precision: str = "32", lr: float = 0.1):
        cfg = OmegaConf.create({"name": precision, "init_scale": 2.0**16, "growth_interval": 2000,
                                "backoff_factor": 0.5})  # fmt: skip
        super().__init__(module, module, torch.optim.SGD(module.parameters(), lr=lr), cfg, torch.device("cpu"))
        self.no_sync_entries = 0
        self.in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        self.no_sync_entries += 1
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def batch(step: int, micro: int, rank: int, size: int = 8) -> dict[str, torch.Tensor]:
    """A deterministic batch of (step, micro, rank)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return {
        "inputs": torch.randn(size, FEATURES, generator=g),
        "targets": torch.randint(0, CLASSES, (size,), generator=g),
    }


def tiny_task() -> Task:
    return Task(batch=batch, metric="accuracy", num_classes=CLASSES)


class Recorder:
    """A component recording every hook call as (hook, value) in ``calls``."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def before_step(self, step, strategy):
        self.calls.append(("before_step", step))

    def after_step(self, result):
        self.calls.append(("after_step", result.step))

    def between_steps(self, out, position):
        self.calls.append(("between_steps", out.steps_done))

    def end(self, out, position):
        self.calls.append(("end", (out.steps_done, out.stopped)))

    def close(self, out):
        self.calls.append(("close", out.steps_done))


class ListLogger:
    """A logger keeping every ``log`` call as (step, values)."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, values, step):
        self.logged.append((step, dict(values)))
