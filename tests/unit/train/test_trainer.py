"""trainer.py's pure parts: what a checkpoint records about the job, and the settings a resumed
run changed that change its numbers (result.json's ``resume_changes``)."""

from __future__ import annotations

from sharded_exp.compose import compose
from sharded_exp.train.trainer import TRAJECTORY_SETTINGS, checkpoint_job, setting_changes


def test_a_checkpoint_records_the_settings_that_steer_the_trajectory():
    cfg = compose(["model=hf_llama", "model.attn_implementation=eager", "trainer.zero_grad=zeros",
                   "optimizer.foreach=false"])  # fmt: skip
    settings = checkpoint_job(cfg)["settings"]
    assert settings == {"trainer.zero_grad": "zeros", "optimizer.foreach": False, "model.attn_implementation": "eager",
                        "data._target_": None, "data.kwargs": None}  # fmt: skip
    assert list(settings) == list(TRAJECTORY_SETTINGS)


def test_a_resume_with_other_settings_records_each_change():
    saved = checkpoint_job(compose(["model=hf_llama", "trainer.zero_grad=zeros"]))
    now = compose(["model=hf_llama", "model.attn_implementation=eager", "trainer.zero_grad=free",
                   "optimizer.foreach=false"])  # fmt: skip
    changes = setting_changes(saved, now)
    assert {c["key"]: (c["checkpoint"], c["config"]) for c in changes} == {
        "trainer.zero_grad": ("zeros", "free"),
        "optimizer.foreach": (None, False),
        "model.attn_implementation": (None, "eager"),
    }
    assert setting_changes(saved, compose(["model=hf_llama", "trainer.zero_grad=zeros"])) == []


def test_a_checkpoint_from_before_settings_were_recorded_compares_its_models_attention_only():
    old = {k: v for k, v in checkpoint_job(compose(["model=hf_llama"])).items() if k != "settings"}
    now = compose(["model=hf_llama", "model.attn_implementation=sdpa", "trainer.zero_grad=free"])
    assert setting_changes(old, now) == [{"key": "model.attn_implementation", "checkpoint": None, "config": "sdpa"}]


def test_a_resume_on_a_custom_dataset_made_with_other_arguments_records_the_change():
    """Its length alone tells two datasets apart only where they differ in length: a factory
    called with other arguments is recorded (and warned of) as a change of trajectory."""
    mine = ["model=custom", "model._target_=pkg.build", "data=custom", "data._target_=pkg.data"]
    saved = checkpoint_job(compose([*mine, "+data.kwargs.n=200"]))
    assert saved["settings"]["data.kwargs"] == {"n": 200} and saved["settings"]["data._target_"] == "pkg.data"
    changes = setting_changes(saved, compose([*mine, "+data.kwargs.n=200", "+data.kwargs.c=3"]))
    assert changes == [{"key": "data.kwargs", "checkpoint": {"n": 200}, "config": {"n": 200, "c": 3}}]
    assert setting_changes(saved, compose([*mine, "+data.kwargs.n=200"])) == []
