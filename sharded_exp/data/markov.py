"""Token sequences from a fixed random Markov chain; the model learns its transitions.

- ``markov``: inputs and next-token targets, shifted here (our GPT's form).
- ``causal_lm``: the same chain in Hugging Face's causal-LM form: ``input_ids``,
  ``attention_mask`` and ``labels`` = ``input_ids`` (the model shifts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharded_exp.data import TASKS, Batch, Task, generator, require_model_fields


@dataclass
class MarkovConfig:
    name: str = "markov"
    seed: int = 1234
    """Seed of the task (the transition matrix), not of the batches."""
    branching: int = 4
    """Likely successors per token: fewer means a more predictable chain."""


@dataclass
class CausalLMConfig(MarkovConfig):
    name: str = "causal_lm"


@TASKS.register("markov", config=MarkovConfig)
def markov_task(cfg: MarkovConfig, model_cfg, batch_size: int) -> Task:
    """Token sequences and their next tokens (targets shifted by one, here)."""
    require_model_fields("markov", "language models (model=gpt)", model_cfg, ("vocab_size", "seq_len"))
    chain = _chain(cfg, model_cfg, batch_size, model_cfg.seq_len + 1)

    def batch(step: int, micro: int, rank: int) -> Batch:
        tokens = chain(step, micro, rank)
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}

    return Task(batch, metric="perplexity", labels="targets")


@TASKS.register("causal_lm", config=CausalLMConfig)
def causal_lm_task(cfg: CausalLMConfig, model_cfg, batch_size: int) -> Task:
    """The chain in Hugging Face's causal-LM form (labels = input_ids; the model shifts)."""
    require_model_fields("causal_lm", "causal language models (model=hf_gpt2)", model_cfg, ("vocab_size", "seq_len"))
    chain = _chain(cfg, model_cfg, batch_size, model_cfg.seq_len)

    def batch(step: int, micro: int, rank: int) -> Batch:
        tokens = chain(step, micro, rank)
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}

    return Task(batch, metric="perplexity", labels="labels", shift_labels=True)


def _chain(cfg: MarkovConfig, model_cfg, batch_size: int, length: int):
    """``sample(step, micro, rank)``: (batch_size, length) tokens of the chain."""
    g = generator(cfg.seed)
    vocab = model_cfg.vocab_size
    # Each token gets `branching` random successors with random weights; 1% of the time
    # the next token is uniform instead, so the chain is learnable but not trivial. Kept
    # as (vocab, branching) tables, not a vocab x vocab matrix: GPT-2-sized vocabularies fit.
    successors = torch.randint(vocab, (vocab, cfg.branching), generator=g)
    weights = torch.rand(vocab, cfg.branching, generator=g) + 0.1

    seed = cfg.seed  # plain ints: config lookups are slow

    def sample(step: int, micro: int, rank: int) -> torch.Tensor:
        gb = generator(seed, step, micro, rank)
        tokens = torch.empty(batch_size, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=gb)
        for t in range(length - 1):
            prev = tokens[:, t]
            pick = torch.multinomial(weights[prev], 1, generator=gb).squeeze(1)
            nxt = successors[prev, pick]
            uniform = torch.rand(batch_size, generator=gb) < 0.01
            tokens[:, t + 1] = torch.where(uniform, torch.randint(vocab, (batch_size,), generator=gb), nxt)
        return tokens

    return sample
