"""markov: token sequences from a fixed random Markov chain; the model learns its transitions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sharded_exp.data import TASKS, Batch, generator, require_model_fields


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
    require_model_fields("markov", "language models (model=gpt)", model_cfg, ("vocab_size", "seq_len"))
    g = generator(cfg.seed)
    vocab = model_cfg.vocab_size
    # Each token gets `branching` random successors with random weights; 1% of the time
    # the next token is uniform instead, so the chain is learnable but not trivial. Kept
    # as (vocab, branching) tables, not a vocab x vocab matrix: GPT-2-sized vocabularies fit.
    successors = torch.randint(vocab, (vocab, cfg.branching), generator=g)
    weights = torch.rand(vocab, cfg.branching, generator=g) + 0.1

    seed, seq_len = cfg.seed, model_cfg.seq_len  # plain ints: config lookups are slow

    def batch(step: int, micro: int, rank: int) -> Batch:
        gb = generator(seed, step, micro, rank)
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
