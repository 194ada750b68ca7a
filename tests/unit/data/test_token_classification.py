"""sharded_exp.data.token_classification: variable-length sequences padded to seq_len, an
attention mask, labels a function of each token and its left neighbour, -100 on padding."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data.token_classification import IGNORE, TokenClassificationConfig, token_classification_task
from sharded_exp.errors import ConfigError

BERT = OmegaConf.create({"name": "hf_bert", "vocab_size": 12, "seq_len": 10, "num_labels": 5})


@pytest.fixture(scope="module")
def batch():
    return token_classification_task(TokenClassificationConfig(min_len=0.5), BERT, 200)(0, 0, 0)


def test_keys_shapes_and_metric():
    task = token_classification_task(TokenClassificationConfig(), BERT, 3)
    b = task(0, 0, 0)
    assert {k: tuple(v.shape) for k, v in b.items()} == {k: (3, 10) for k in ("input_ids", "attention_mask", "labels")}
    assert (task.metric, task.labels, task.num_classes) == ("token_accuracy", "labels", 5)
    assert task.padded is True  # its sequences are shorter than seq_len: batches pad


def test_the_mask_is_a_prefix_at_least_min_len_long(batch):
    mask = batch["attention_mask"]
    lengths = mask.sum(1)
    assert int(lengths.min()) >= 5 and int(lengths.max()) <= 10  # 0.5 * seq_len
    assert int(lengths.max()) == 10  # full length is drawn too
    assert torch.equal(mask, (torch.arange(10)[None, :] < lengths[:, None]).long())


def test_padding_is_token_zero_with_label_minus_100(batch):
    pad = batch["attention_mask"] == 0
    assert bool((batch["input_ids"][pad] == 0).all()) and bool((batch["labels"][pad] == IGNORE).all())
    real = ~pad
    assert int(batch["input_ids"][real].min()) >= 1 and int(batch["input_ids"][real].max()) < 12
    assert int(batch["labels"][real].min()) >= 0 and int(batch["labels"][real].max()) < 5


def test_a_label_is_a_function_of_the_token_and_its_left_neighbour(batch):
    rule: dict[tuple[int, int], int] = {}
    ids, labels, mask = batch["input_ids"].tolist(), batch["labels"].tolist(), batch["attention_mask"].tolist()
    for row, lab, m in zip(ids, labels, mask):
        for t in range(len(row)):
            if not m[t]:
                continue
            key = (row[t], row[t - 1] if t else 0)  # the first token's neighbour is 0
            assert rule.setdefault(key, lab[t]) == lab[t], key
    by_token: dict[int, set[int]] = {}
    for (tok, _), lab in rule.items():
        by_token.setdefault(tok, set()).add(lab)
    assert any(len(v) > 1 for v in by_token.values())  # the neighbour matters for some token


def test_a_tiny_min_len_still_gives_one_token():
    b = token_classification_task(TokenClassificationConfig(min_len=0.0), BERT, 300)(1, 0, 0)
    assert int(b["attention_mask"].sum(1).min()) >= 1


def test_a_model_without_labels_is_refused():
    with pytest.raises(ConfigError, match=r"model.num_labels \(model=gpt has no num_labels\)"):
        token_classification_task(
            TokenClassificationConfig(), OmegaConf.create({"name": "gpt", "vocab_size": 3, "seq_len": 4}), 2
        )
