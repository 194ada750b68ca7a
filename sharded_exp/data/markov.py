"""Token sequences from a fixed random Markov chain; the model learns its transitions.

- ``markov``: inputs and next-token targets, shifted here (our GPT's form).
- ``causal_lm``: the same chain in Hugging Face's causal-LM form: ``input_ids``,
  ``attention_mask`` and ``labels`` = ``input_ids`` (the model shifts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharded_exp.config import Sealed, bounded, check_fed
from sharded_exp.data import TASKS, Batch, Task, generator


@dataclass
class MarkovConfig(Sealed):
    FEEDS = "language models (model=gpt)"
    MODEL_FIELDS = ("vocab_size", "seq_len")

    name: str = "markov"
    seed: int = 1234
    """Seed of the task (the transition matrix), not of the batches."""
    branching: int = bounded(4, at_least=1)
    """Likely successors per token: fewer means a more predictable chain."""


@dataclass
class CausalLMConfig(MarkovConfig):
    FEEDS = "causal language models (model=hf_gpt2)"

    name: str = "causal_lm"


@TASKS.register("markov", config=MarkovConfig)
def markov_task(cfg: MarkovConfig, model_cfg, batch_size: int) -> Task:
    """Token sequences and their next tokens (targets shifted by one, here)."""
    check_fed(cfg, model_cfg, MarkovConfig)
    chain = _chain(cfg, model_cfg, batch_size, model_cfg.seq_len + 1)

    def batch(step: int, micro: int, rank: int) -> Batch:
        tokens = chain(step, micro, rank)
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}

    return Task(batch, metric="perplexity", labels="targets")


@TASKS.register("causal_lm", config=CausalLMConfig)
def causal_lm_task(cfg: CausalLMConfig, model_cfg, batch_size: int) -> Task:
    """The chain in Hugging Face's causal-LM form (labels = input_ids; the model shifts)."""
    check_fed(cfg, model_cfg, CausalLMConfig)
    chain = _chain(cfg, model_cfg, batch_size, model_cfg.seq_len)

    def batch(step: int, micro: int, rank: int) -> Batch:
        tokens = chain(step, micro, rank)
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}

    # every position is a token of the chain: the attention_mask is all ones
    return Task(batch, metric="perplexity", labels="labels", shift_labels=True, padded=False)


LEVELS = 64
"""Successor probabilities are kept in steps of 1/LEVELS (a table lookup per token)."""


def _chain(cfg: MarkovConfig, model_cfg, batch_size: int, length: int):
    """``sample(step, micro, rank)``: (batch_size, length) tokens of the chain."""
    g = generator(cfg.seed)
    vocab = model_cfg.vocab_size
    # Each token gets `branching` random successors with random weights; 1% of the time
    # the next token is uniform instead, so the chain is learnable but not trivial.
    successors = torch.randint(vocab, (vocab, cfg.branching), generator=g)
    weights = torch.rand(vocab, cfg.branching, generator=g) + 0.1
    # next_token[v * LEVELS + q]: the successor of v for a draw q of LEVELS equal levels
    # (inverse CDF at the level's midpoint). A vocab x LEVELS table of int32, not a
    # vocab x vocab matrix: 12 MiB for GPT-2's vocabulary.
    bounds = (weights / weights.sum(1, keepdim=True)).cumsum(1)
    midpoints = (torch.arange(LEVELS) + 0.5) / LEVELS
    branch = (bounds[:, None, :] <= midpoints[None, :, None]).sum(2).clamp_(max=cfg.branching - 1)
    next_token = successors.gather(1, branch).to(torch.int32).reshape(-1)

    seed = cfg.seed  # plain ints: config lookups are slow

    def sample(step: int, micro: int, rank: int) -> torch.Tensor:
        # Every random number is drawn up front, in whole tensors; only the chain's
        # dependence on the previous token stays a loop, of one lookup per position
        # (a loop of draws per token took 130 ms at 8 x 1025 tokens; this takes ~15).
        gb = generator(seed, step, micro, rank)
        tokens = torch.empty(length, batch_size, dtype=torch.int32)
        tokens[0] = torch.randint(vocab, (batch_size,), generator=gb)
        levels = torch.randint(LEVELS, (length - 1, batch_size), generator=gb, dtype=torch.int32)
        restart = torch.rand(length - 1, batch_size, generator=gb) < 0.01
        uniform = torch.randint(vocab, (length - 1, batch_size), generator=gb, dtype=torch.int32)
        prev = tokens[0]
        for t in range(length - 1):
            prev = torch.where(restart[t], uniform[t], next_token[prev * LEVELS + levels[t]])
            tokens[t + 1] = prev
        return tokens.T.long().contiguous()

    return sample
