"""sharded_exp.data.markov: the markov task (inputs and next-token targets) and causal_lm
(Hugging Face's form), from a fixed random chain with `branching` likely successors."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data.markov import CausalLMConfig, MarkovConfig, causal_lm_task, markov_task
from sharded_exp.errors import ConfigError

GPT = OmegaConf.create({"name": "gpt", "vocab_size": 20, "seq_len": 16})


def test_markov_targets_are_the_inputs_next_tokens():
    b = markov_task(MarkovConfig(), GPT, 3)(0, 0, 0)
    assert b["input_ids"].shape == (3, 16) and b["targets"].shape == (3, 16)
    assert torch.equal(b["input_ids"][:, 1:], b["targets"][:, :-1])
    assert b["input_ids"].dtype == torch.long
    assert 0 <= int(b["input_ids"].min()) and int(b["targets"].max()) < 20


def test_batches_are_a_function_of_step_micro_and_rank():
    task = markov_task(MarkovConfig(), GPT, 2)
    assert torch.equal(task(3, 1, 2)["input_ids"], markov_task(MarkovConfig(), GPT, 2)(3, 1, 2)["input_ids"])
    seen = {tuple(task(*k)["input_ids"].flatten().tolist()) for k in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]}
    assert len(seen) == 4


def transitions(tokens: torch.Tensor) -> dict[int, Counter]:
    out: dict[int, Counter] = defaultdict(Counter)
    for row in tokens.tolist():
        for a, b in zip(row, row[1:]):
            out[a][b] += 1
    return out


@pytest.mark.parametrize("branching", [1, 3])
def test_each_token_is_followed_by_at_most_branching_successors_but_for_restarts(branching):
    tokens = markov_task(MarkovConfig(branching=branching), GPT, 64)(0, 0, 0)["input_ids"]
    table = transitions(tokens)
    total = sum(sum(c.values()) for c in table.values())
    likely = sum(sum(n for _, n in c.most_common(branching)) for c in table.values())
    assert likely / total > 0.97  # 1% of steps restart uniformly
    if branching == 3:  # not a deterministic chain: some token has more than one successor
        assert any(len([n for n in c.values() if n > 5]) > 1 for c in table.values())


def test_the_task_seed_changes_the_chain_not_only_the_batches():
    a = transitions(markov_task(MarkovConfig(seed=1, branching=1), GPT, 64)(0, 0, 0)["input_ids"])
    b = transitions(markov_task(MarkovConfig(seed=2, branching=1), GPT, 64)(0, 0, 0)["input_ids"])
    rule_a = {t: c.most_common(1)[0][0] for t, c in a.items()}
    rule_b = {t: c.most_common(1)[0][0] for t, c in b.items()}
    assert rule_a != rule_b


def test_causal_lm_is_the_chain_in_hugging_faces_form():
    task = causal_lm_task(CausalLMConfig(), GPT, 2)
    b = task(0, 0, 0)
    assert set(b) == {"input_ids", "attention_mask", "labels"}
    assert b["input_ids"].shape == (2, 16) and torch.equal(b["labels"], b["input_ids"])
    assert torch.equal(b["attention_mask"], torch.ones(2, 16, dtype=torch.long))
    assert (task.metric, task.labels, task.shift_labels) == ("perplexity", "labels", True)


def test_causal_lms_batches_never_pad_as_its_task_says():
    """Task.padded=False tells the fake step that transformers will find no padding."""
    task = causal_lm_task(CausalLMConfig(), GPT, 4)
    assert task.padded is False
    assert all(
        bool(task(step, micro, rank)["attention_mask"].all())
        for step in range(3)
        for micro in range(2)
        for rank in range(2)
    )


def test_markov_scores_perplexity_on_unshifted_targets():
    task = markov_task(MarkovConfig(), GPT, 1)
    assert (task.metric, task.labels, task.shift_labels, task.dataset) == ("perplexity", "targets", False, None)


def test_a_model_without_a_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="data=markov feeds language models"):
        markov_task(MarkovConfig(), OmegaConf.create({"name": "mlp", "in_features": 3}), 1)
    with pytest.raises(ConfigError, match="data=causal_lm feeds causal language models"):
        causal_lm_task(CausalLMConfig(), OmegaConf.create({"name": "mlp", "seq_len": 3}), 1)
