"""sharded_exp.config: the typed schemas (defaults live in the dataclasses; the composed
config refuses a typo, a wrong type or a value outside an enum) and option_name, which
reads an option alike from an enum member or a plain name."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sharded_exp import config
from sharded_exp.compose import compose
from sharded_exp.config import Accelerator, CheckpointFormat, ZeroGrad, option_name


@pytest.mark.parametrize(
    "value, name",
    [(ZeroGrad.zeros, "zeros"), (Accelerator.gpu, "gpu"), ("free", "free"), (16, "16"), ("bf16", "bf16"), (None, None)],
)
def test_option_name_reads_enum_members_and_plain_names_alike(value, name):
    assert option_name(value) == name


def test_option_name_of_an_enum_is_its_value_not_its_member_name():
    assert option_name(config.CompileMode.reduce_overhead) == "reduce_overhead"
    assert option_name(CheckpointFormat.consolidated) == str(CheckpointFormat.consolidated.value)
    assert "CheckpointFormat" not in option_name(CheckpointFormat.dcp)


def test_the_composed_default_holds_the_schemas_defaults():
    cfg = compose(["logger=none"])
    t = config.TrainerConfig()
    for key in ("world_size", "steps", "warmup_steps", "batch_size", "grad_accum", "grad_clip", "timeout_s"):
        assert cfg.trainer[key] == getattr(t, key), key
    assert cfg.trainer.accelerator == Accelerator.auto and cfg.trainer.zero_grad == ZeroGrad.free
    assert cfg.precision.init_scale == 2.0**16 and cfg.optimizer.betas == [0.9, 0.999]
    assert cfg.paths.output_dir == "outputs"


def test_an_optimizer_without_a_name_is_missing_until_a_group_sets_it():
    node = OmegaConf.structured(config.OptimizerConfig)
    assert OmegaConf.is_missing(node, "name")
    assert config.OptimizerConfig(name="sgd").betas is not config.OptimizerConfig(name="sgd").betas  # own lists


@pytest.mark.parametrize(
    "override",
    [
        "trainer.stepz=3",  # a typo in a key
        "trainer.world_size=abc",  # a wrong type
        "trainer.accelerator=tpu",  # outside the enum
        "trainer.zero_grad=none",
        "trainer.activation_checkpointing=half",
        "trainer.checkpoint_format=zip",
        "trainer.existing_checkpoints=delete",
        "trainer.memory_snapshot=sometimes",
        "optimizer.foreach=sometimes",
        "precision.growth_interval=1.5",
    ],
)
def test_the_schema_refuses_a_bad_key_type_or_choice_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose([override])


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("trainer.zero_grad=zeros", ("trainer", "zero_grad"), ZeroGrad.zeros),
        ("trainer.accelerator=cpu", ("trainer", "accelerator"), Accelerator.cpu),
        ("trainer.memory_limit_mib=12.5", ("trainer", "memory_limit_mib"), 12.5),
        ("trainer.freeze=[embed.*]", ("trainer", "freeze"), ["embed.*"]),
    ],
)
def test_allowed_values_compose_to_their_typed_values(override, key, value):
    cfg = compose([override])
    assert cfg[key[0]][key[1]] == value


def test_the_planner_root_has_the_job_groups_and_plan_defaults():
    cfg = compose([], "plan")
    assert set(config.JobGroups.__dataclass_fields__) <= set(cfg)
    assert list(cfg.plan.world_sizes) == [1, 2, 4, 8, 64]
    assert cfg.plan.device == config.PlanDevice.cuda and cfg.plan.levers == ["none"]
    assert "logger" not in cfg
