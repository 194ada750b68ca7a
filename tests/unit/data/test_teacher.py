"""sharded_exp.data.teacher: Gaussian inputs labelled by the argmax of a fixed random
two-layer network."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data import generator
from sharded_exp.data.teacher import TeacherConfig, teacher_task
from sharded_exp.errors import ConfigError

MLP = OmegaConf.create({"name": "mlp", "in_features": 6, "num_classes": 4})


def test_a_batch_holds_inputs_and_class_targets():
    task = teacher_task(TeacherConfig(), MLP, 5)
    b = task(0, 0, 0)
    assert b["inputs"].shape == (5, 6) and b["inputs"].dtype == torch.float32
    assert b["targets"].shape == (5,) and b["targets"].dtype == torch.long
    assert (task.metric, task.labels, task.num_classes) == ("accuracy", "targets", 4)


def test_labels_are_the_teachers_argmax():
    cfg = TeacherConfig(seed=3, teacher_hidden=8)
    b = teacher_task(cfg, MLP, 256)(2, 1, 0)
    g = generator(3)
    w1, w2 = torch.randn(6, 8, generator=g), torch.randn(8, 4, generator=g)
    assert torch.equal(b["targets"], (torch.tanh(b["inputs"] @ w1) @ w2).argmax(1))
    assert len(set(b["targets"].tolist())) > 1  # not one class


def test_inputs_are_drawn_from_the_batch_keys_not_the_task_seed():
    x = teacher_task(TeacherConfig(seed=1), MLP, 4)(0, 0, 0)["inputs"]
    assert torch.equal(x, teacher_task(TeacherConfig(seed=1), MLP, 4)(0, 0, 0)["inputs"])
    assert not torch.equal(x, teacher_task(TeacherConfig(seed=1), MLP, 4)(0, 0, 1)["inputs"])
    assert torch.equal(x, torch.randn(4, 6, generator=generator(1, 0, 0, 0)))


def test_a_model_without_classes_is_refused():
    with pytest.raises(ConfigError, match="data=teacher feeds classifiers"):
        teacher_task(TeacherConfig(), OmegaConf.create({"name": "gpt", "vocab_size": 3, "seq_len": 4}), 2)
