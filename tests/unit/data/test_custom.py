"""sharded_exp.data.custom: a user's Dataset from data._target_(**data.kwargs), refused before
any rank when it is not one, or its batches are not dicts holding the labels."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data.custom import CustomDataConfig, custom_task
from sharded_exp.errors import ConfigError

H = "tests.helpers.unit_config"
MODEL = OmegaConf.create({"name": "custom"})


def cfg(target: str | None = f"{H}.indexed", **kw):
    c = OmegaConf.structured(CustomDataConfig)
    if target is not None:
        c._target_ = target
    for k, v in kw.items():
        c[k] = v
    return c


def test_the_factory_is_called_with_its_kwargs():
    task = custom_task(cfg(kwargs={"n": 7}, metric="accuracy", num_classes=3, labels="labels"), MODEL, 2)
    assert len(task.dataset) == 7
    assert (task.metric, task.labels, task.num_classes, task.shift_labels) == ("accuracy", "labels", 3, False)
    assert task.collate is torch.utils.data.default_collate
    b = task(0, 0, 0)
    assert b["x"].shape == (2,) and torch.equal(b["labels"], b["x"] % 3)


def test_settings_of_the_loader_come_from_the_config():
    task = custom_task(cfg(seed=5, shuffle=False, num_workers=0, shift_labels=True), MODEL, 1)
    assert (task.seed, task.shuffle, task.num_workers, task.shift_labels, task.fingerprint) == (5, False, 0, True, None)


def test_the_datasets_own_collate_fn_is_used():
    task = custom_task(cfg(f"{H}.Pairs", kwargs={"n": 4}), MODEL, 3)
    assert task(0, 0, 0)["own"] is True


def test_evaluation_batches_are_a_function_of_their_keys():
    task = custom_task(cfg(kwargs={"n": 50}), MODEL, 4)
    assert torch.equal(task(1, 0, 2)["x"], task(1, 0, 2)["x"])
    assert not torch.equal(task(1, 0, 2)["x"], task(1, 0, 3)["x"])


@pytest.mark.parametrize(
    "c, message",
    [
        (cfg(None), "data=custom needs data._target_=package.module.factory"),
        (cfg("tests.helpers.unit_config.nope"), "data._target_=tests.helpers.unit_config.nope cannot be imported"),
        (cfg(f"{H}.not_a_dataset"), "returned list, not a map-style torch.utils.data.Dataset"),
        (
            cfg(f"{H}.tuples"),
            "'s batches must be dicts of the model's keyword arguments with the labels under "
            "data.labels='labels'; a batch of item 0 is list",
        ),
        (cfg(labels="targets"), "under data.labels='targets'; a batch of item 0 is dict with keys x, labels"),
        (cfg(metric="accuracy"), "data=custom with data.metric=accuracy needs data.num_classes"),
        (cfg(metric="token_accuracy", num_classes=0), "data.metric=token_accuracy needs data.num_classes"),
        (cfg(kwargs={"n": 0}), "holds no samples (data=custom)"),
    ],
)
def test_what_cannot_be_trained_on_is_refused_naming_it(c, message):
    with pytest.raises(ConfigError) as err:
        custom_task(c, MODEL, 2)
    assert message in str(err.value)
