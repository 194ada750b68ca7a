"""token_classification: labels a fixed function of each token and its left neighbour,
variable lengths with padding, an attention mask, and label -100 on padding (ignored by
the loss and the metrics), as in a named-entity-recognition data set (CoNLL-2003 has 9
labels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sharded_exp.config import Sealed, bounded, check_fed
from sharded_exp.data import TASKS, Task, generator

IGNORE = -100


@dataclass
class TokenClassificationConfig(Sealed):
    FEEDS = "token classifiers (model=hf_bert)"
    MODEL_FIELDS = ("vocab_size", "seq_len", "num_labels")

    name: str = "token_classification"
    seed: int = 1234
    """Seed of the task (the labelling rule), not of the batches."""
    min_len: float = bounded(0.5, at_least=0, at_most=1)
    """Shortest sequence as a share of model.seq_len, from 0 (one token) to 1 (every sequence
    full); lengths are uniform up to seq_len."""


@TASKS.register("token_classification", config=TokenClassificationConfig)
def token_classification_task(cfg: TokenClassificationConfig, model_cfg, batch_size: int) -> Task:
    """input_ids, attention_mask and labels (-100 on padding) for a token classifier."""
    check_fed(cfg, model_cfg, TokenClassificationConfig)
    vocab, seq_len, labels = model_cfg.vocab_size, model_cfg.seq_len, model_cfg.num_labels
    g = generator(cfg.seed)
    # label(token, left neighbour) = (class of the token + a 0/1 shift set by the neighbour)
    # mod labels: a lookup plus one bit of context, learnable in a few hundred steps
    token_class = torch.randint(labels, (vocab,), generator=g)
    shift = torch.randint(2, (vocab,), generator=g)
    shortest = max(1, int(cfg.min_len * seq_len))
    seed = cfg.seed

    def label_of(tokens: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)
        return (token_class[tokens] + shift[prev]) % labels

    def batch(step: int, micro: int, rank: int):
        gb = generator(seed, step, micro, rank)
        tokens = torch.randint(1, vocab, (batch_size, seq_len), generator=gb)  # 0 is padding
        lengths = torch.randint(shortest, seq_len + 1, (batch_size,), generator=gb)
        mask = torch.arange(seq_len)[None, :] < lengths[:, None]
        input_ids = torch.where(mask, tokens, torch.zeros_like(tokens))
        y = torch.where(mask, label_of(tokens), torch.full_like(tokens, IGNORE))
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": y}

    return Task(batch, metric="token_accuracy", labels="labels", num_classes=labels)
