"""sharded_exp.data (the package): the seeded batch streams, the model-field check, the Task's
reading of a model's output and labels, moving a batch, and the planner's stand-in probes."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data import (
    TASKS,
    ContractError,
    Task,
    build_task,
    each_tensor,
    generator,
    probe_batch,
    probe_task,
)


def draw(g: torch.Generator) -> list[float]:
    return torch.rand(4, generator=g).tolist()


def test_the_same_keys_give_the_same_stream():
    assert draw(generator(7, 1, 2, 3)) == draw(generator(7, 1, 2, 3))


def test_every_key_and_its_position_change_the_stream():
    streams = [draw(generator(*keys)) for keys in
               [(0,), (0, 0), (0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 2), (0, 2, 1), (1, 0, 0, 0)]]  # fmt: skip
    assert len({tuple(s) for s in streams}) == len(streams)


def test_the_loss_comes_from_an_object_or_a_dict():
    loss = torch.tensor(1.5)
    assert Task.loss_of({"loss": loss}) is loss

    class Out:
        pass

    out = Out()
    out.loss = loss
    assert Task.loss_of(out) is loss
    with pytest.raises(ContractError, match="the model returned dict without a loss"):
        Task.loss_of({"logits": loss})
    with pytest.raises(ContractError, match="returned Tensor without a loss"):
        Task.loss_of(loss)


def test_predictions_align_logits_and_labels_shifting_a_causal_lm():
    logits = torch.arange(2 * 5 * 3).reshape(2, 5, 3).float()
    labels = torch.arange(10).reshape(2, 5)
    task = Task(lambda s, m, r: {}, metric="perplexity", labels="labels", shift_labels=True)
    got_logits, got_labels = task.predictions({"logits": logits}, {"labels": labels})
    assert torch.equal(got_logits, logits[:, :4]) and torch.equal(got_labels, labels[:, 1:])
    plain = Task(lambda s, m, r: {}, metric="accuracy", labels="targets")
    got_logits, got_labels = plain.predictions({"logits": logits}, {"targets": labels})
    assert got_logits is logits and got_labels is labels
    with pytest.raises(ContractError, match="no `logits`"):
        plain.predictions({"loss": 1}, {"targets": labels})


def test_calling_a_task_is_calling_its_batch():
    task = Task(lambda s, m, r: {"k": (s, m, r)}, metric="accuracy")
    assert task(1, 2, 3) == {"k": (1, 2, 3)}


def test_each_tensor_moves_tensors_and_passes_other_values():
    batch = {"x": torch.ones(2), "name": ["a", "b"], "flag": True}
    out = each_tensor(batch, lambda t: t * 2)
    assert torch.equal(out["x"], torch.full((2,), 2.0)) and out["name"] == ["a", "b"] and out["flag"] is True


def test_a_file_task_without_a_path_is_probed_by_its_synthetic_stand_in():
    model = OmegaConf.create({"name": "hf_bert", "vocab_size": 30, "seq_len": 12, "num_labels": 5})
    conll = OmegaConf.structured(TASKS.config_class("conll"))
    sample = probe_batch(conll, model, 0)
    assert set(sample) == {"input_ids", "attention_mask", "labels"} and sample["input_ids"].shape == (1, 12)
    gpt = OmegaConf.create({"name": "hf_gpt2", "vocab_size": 30, "seq_len": 12})
    text = OmegaConf.structured(TASKS.config_class("text_file"))
    sample = probe_batch(text, gpt, 0)
    assert torch.equal(sample["labels"], sample["input_ids"]) and sample["input_ids"].shape == (1, 12)
    hf = OmegaConf.structured(TASKS.config_class("hf_dataset"))
    hf.kind = "token_classification"
    assert probe_batch(hf, model, 0)["labels"].min() >= -100
    # the stand-in says whether the user's batches pad as the user's own task would
    assert probe_task(conll, model).padded is True and probe_task(text, gpt).padded is False
    hf.kind = "causal_lm"
    assert probe_task(hf, gpt).padded is False


def test_a_synthetic_task_is_probed_with_one_sample():
    model = OmegaConf.create({"name": "mlp", "in_features": 6, "num_classes": 3})
    sample = probe_batch(OmegaConf.structured(TASKS.config_class("teacher")), model, 1)
    assert sample["inputs"].shape == (1, 6) and sample["targets"].shape == (1,)
    assert build_task(OmegaConf.structured(TASKS.config_class("teacher")), model, 5)(0, 0, 0)["inputs"].shape == (5, 6)


def test_every_shipped_task_is_registered():
    assert {"teacher", "markov", "causal_lm", "token_classification", "text_file", "conll", "hf_dataset",
            "custom"} <= set(TASKS.names())  # fmt: skip
