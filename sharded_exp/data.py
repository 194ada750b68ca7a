"""Synthetic, learnable tasks, generated deterministically from (seed, step, micro-batch, rank).

No files, no downloads: every strategy, world size and rerun sees exactly the same samples
for the same (step, micro-batch, rank), which is what makes parity against DDP meaningful.
A task builder receives its own config and the model config it must feed; it returns a
callable ``batch(step, micro, rank) -> dict`` of keyword arguments for the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sharded_exp.registry import Registry

TASKS = Registry("data")

Batch = dict[str, torch.Tensor]


def _generator(seed: int, *keys: int) -> torch.Generator:
    # A distinct, reproducible stream per (seed, step, micro, rank); the mix keeps nearby
    # keys from producing correlated streams.
    g = torch.Generator()
    mixed = seed
    for k in keys:
        mixed = (mixed * 1_000_003 + k + 1) % (2**62)
    g.manual_seed(mixed)
    return g


@dataclass
class TeacherConfig:
    name: str = "teacher"
    seed: int = 1234
    """Seed of the task (the teacher's weights), not of the batches."""
    teacher_hidden: int = 32
    """Hidden width of the fixed random teacher network that labels the inputs."""


@TASKS.register("teacher", config=TeacherConfig)
def teacher_task(cfg: TeacherConfig, model_cfg, batch_size: int) -> Callable[..., Batch]:
    """Gaussian inputs labelled by the argmax of a fixed random 2-layer teacher network."""
    if model_cfg.name != "mlp":
        from sharded_exp.config import ConfigError

        raise ConfigError(f"data=teacher feeds classifiers (model=mlp), not model={model_cfg.name}")
    g = _generator(cfg.seed)
    w1 = torch.randn(model_cfg.in_features, cfg.teacher_hidden, generator=g)
    w2 = torch.randn(cfg.teacher_hidden, model_cfg.num_classes, generator=g)

    seed, in_features = cfg.seed, model_cfg.in_features  # plain ints: config lookups are slow

    def batch(step: int, micro: int, rank: int) -> Batch:
        x = torch.randn(batch_size, in_features, generator=_generator(seed, step, micro, rank))
        y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
        return {"inputs": x, "targets": y}

    return batch


@dataclass
class MarkovConfig:
    name: str = "markov"
    seed: int = 1234
    """Seed of the task (the transition matrix), not of the batches."""
    branching: int = 4
    """Likely successors per token: fewer means a more predictable chain."""


@TASKS.register("markov", config=MarkovConfig)
def markov_task(cfg: MarkovConfig, model_cfg, batch_size: int) -> Callable[..., Batch]:
    """Token sequences from a fixed random Markov chain; the model learns its transitions."""
    if model_cfg.name != "gpt":
        from sharded_exp.config import ConfigError

        raise ConfigError(f"data=markov feeds language models (model=gpt), not model={model_cfg.name}")
    g = _generator(cfg.seed)
    vocab = model_cfg.vocab_size
    # Each token gets `branching` random successors with random weights; 1% of the time
    # the next token is uniform instead, so the chain is learnable but not trivial. Kept
    # as (vocab, branching) tables, not a vocab x vocab matrix: GPT-2-sized vocabularies fit.
    successors = torch.randint(vocab, (vocab, cfg.branching), generator=g)
    weights = torch.rand(vocab, cfg.branching, generator=g) + 0.1

    seed, seq_len = cfg.seed, model_cfg.seq_len  # plain ints: config lookups are slow

    def batch(step: int, micro: int, rank: int) -> Batch:
        gb = _generator(seed, step, micro, rank)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=gb)
        for t in range(seq_len):
            prev = tokens[:, t]
            pick = torch.multinomial(weights[prev], 1, generator=gb).squeeze(1)
            nxt = successors[prev, pick]
            uniform = torch.rand(batch_size, generator=gb) < 0.01
            tokens[:, t + 1] = torch.where(uniform, torch.randint(vocab, (batch_size,), generator=gb), nxt)
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}

    return batch


def build_task(cfg, model_cfg, batch_size: int) -> Callable[..., Batch]:
    return TASKS.builder(cfg.name)(cfg, model_cfg, batch_size)
