"""sharded_exp.job.spec: the JobSpec (frozen, picklable, its typed config as a read-only tree)
and decided_config (the parent's decisions in place: options by name, interpolations kept in
the YAML, and typed)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from sharded_exp.checkpoint.plan import CheckpointPlan
from sharded_exp.config import Config, GradZeroing, TrainerConfig, ZeroGrad
from sharded_exp.job.spec import JobSpec, Pickled, decided_config


def plan(**kw) -> CheckpointPlan:
    values = dict(directory="/ckpt", format="dcp", every=0, keep=0, asynchronous=False, existing="refuse",
                  resume=None, start_step=0)  # fmt: skip
    return CheckpointPlan(**{**values, **kw})


def spec(**kw) -> JobSpec:
    typed = Config(trainer=TrainerConfig(steps=3, warmup_steps=0, freeze=["a"]))
    values = dict(config={"trainer": {"steps": 3, "freeze": ["a"]}, "model": {"name": "mlp"}}, typed=typed, output_dir="/out",
                  device_type="cpu", world_size=2, params=10, prediction={}, checkpoint=plan(),
                  zero_grad=GradZeroing(ZeroGrad.free, ZeroGrad.free))  # fmt: skip
    return JobSpec(**{**values, **kw})


def test_a_job_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec().world_size = 4


def test_a_job_spec_defaults_to_a_spawned_job_at_info_level():
    s = spec()
    assert (s.launcher, s.env, s.parent_pid, s.log_level) == ("spawn", {}, None, 20)


def test_a_job_spec_survives_pickling_its_typed_config_pickled_apart():
    s = spec()
    back = pickle.loads(pickle.dumps(s))
    assert isinstance(back.typed, Pickled) and back.typed_config() == s.typed
    assert dataclasses.replace(back, typed=s.typed) == s
    assert back.cfg() == s.cfg()
    again = pickle.loads(pickle.dumps(dataclasses.replace(back, parent_pid=7)))  # passed on as it came
    assert again.typed == back.typed and again.typed_config() == s.typed


def test_cfg_is_a_read_only_copy_of_the_typed_config_with_its_enums():
    s = spec()
    cfg = s.cfg()
    assert cfg.trainer.steps == 3 and list(cfg.trainer.freeze) == ["a"]
    assert cfg.trainer.zero_grad is ZeroGrad.free  # typed as the composed config is
    with pytest.raises(ReadonlyConfigError):
        cfg.trainer.steps = 4
    s.typed.trainer.freeze.append("b")  # the tree is a deep copy, made at each call
    assert list(cfg.trainer.freeze) == ["a"]


def test_decided_config_puts_the_world_size_and_checkpoint_plan_in_place():
    cfg = OmegaConf.create({"paths": {"output_dir": "outs"},
                            "trainer": {"world_size": 2, "checkpoint_dir": None, "checkpoint_format": "auto",
                                        "resume": "auto", "log_dir": "${paths.output_dir}/logs"}})  # fmt: skip
    config, yaml, _ = decided_config(cfg, 8, plan(directory="/abs/ckpt", format="consolidated", resume="/abs/ckpt/s4"))
    assert config["trainer"] == {"world_size": 8, "checkpoint_dir": "/abs/ckpt", "checkpoint_format": "consolidated",
                                 "resume": "/abs/ckpt/s4", "log_dir": "outs/logs"}  # fmt: skip
    assert "${paths.output_dir}/logs" in yaml and "world_size: 8" in yaml  # interpolations kept


def test_decided_config_gives_options_by_name_not_as_enums():
    from sharded_exp.config import TrainerConfig

    cfg = OmegaConf.create({"trainer": OmegaConf.structured(TrainerConfig)})
    config, _, typed = decided_config(cfg, 2, plan())
    assert config["trainer"]["zero_grad"] == "free" and type(config["trainer"]["zero_grad"]) is str
    assert typed["trainer"].zero_grad is ZeroGrad.free and typed["trainer"].world_size == 2
    assert config["trainer"]["checkpoint_format"] == "dcp"
