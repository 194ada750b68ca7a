"""sharded_exp.config: the typed schemas (defaults live in the dataclasses; the composed
config refuses a typo, a wrong type or a value outside an enum) and option_name, which
reads an option alike from an enum member or a plain name; each schema's own range checks
(``__post_init__``), which run when :func:`sharded_exp.config.typed` makes a composed config typed."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from sharded_exp import config
from sharded_exp.compose import compose
from sharded_exp.config import Accelerator, CheckpointFormat, ZeroGrad, option_name
from sharded_exp.errors import ConfigError


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


# ------------------------------------------------------ each schema checks its own ranges
def refused(make, message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make()


@pytest.mark.parametrize(
    "key", ["world_size", "steps", "batch_size", "grad_accum", "log_interval", "ac_every", "profile_steps"]
)
def test_trainer_counts_below_one_are_refused_and_one_is_allowed(key):
    fine = {key: 1, "warmup_steps": 0} if key == "steps" else {key: 1}
    config.TrainerConfig(**fine)
    refused(lambda: config.TrainerConfig(**{key: 0}), f"trainer.{key}=0 must be >= 1")


def test_trainer_warmup_must_leave_a_timed_step():
    config.TrainerConfig(steps=5, warmup_steps=4)
    config.TrainerConfig(steps=5, warmup_steps=0)
    refused(
        lambda: config.TrainerConfig(steps=5, warmup_steps=5),
        "trainer.warmup_steps=5 must be >= 0 and < trainer.steps=5",
    )
    refused(lambda: config.TrainerConfig(warmup_steps=-1), "trainer.warmup_steps=-1 must be >= 0")


def test_trainer_profiled_steps_must_fit_after_warmup():
    config.TrainerConfig(profile=True, steps=6, warmup_steps=2, profile_steps=3)  # 2 + 3 < 6
    config.TrainerConfig(profile=False, steps=6, warmup_steps=2, profile_steps=4)  # not profiling: not checked
    refused(
        lambda: config.TrainerConfig(profile=True, steps=6, warmup_steps=2, profile_steps=4),
        "trainer.profile_steps=4 needs trainer.steps=6 > trainer.warmup_steps=2 + profile_steps",
    )


@pytest.mark.parametrize(
    "key, bad, fine, message",
    [
        ("min_timed_steps", -1, 0, "trainer.min_timed_steps=-1 must be >= 0 (0: no check)"),
        ("grad_clip", -0.5, 0.0, "trainer.grad_clip=-0.5 must be >= 0 (0 turns clipping off)"),
        ("timeout_s", 0.0, 0.1, "trainer.timeout_s=0.0 must be > 0"),
        ("eval_every", -1, 0, "trainer.eval_every=-1 must be >= 0 (0 = only at the end)"),
        ("eval_batches", -1, 0, "trainer.eval_batches=-1 must be >= 0 (0 = no evaluation)"),
        ("checkpoint_every", -1, 0, "trainer.checkpoint_every=-1 must be >= 0 (0 = off)"),
        ("keep_checkpoints", -2, 0, "trainer.keep_checkpoints=-2 must be >= 0 (0 = keep all)"),
        ("stop_grace_s", 0.0, 0.5, "trainer.stop_grace_s=0.0 must be > 0"),
        ("memory_limit_mib", 0.0, None, "trainer.memory_limit_mib=0.0 must be > 0 (or null for no budget)"),
    ],
)
def test_trainer_ranges_refuse_just_outside_and_allow_the_edge(key, bad, fine, message):
    config.TrainerConfig(**{key: fine})
    refused(lambda: config.TrainerConfig(**{key: bad}), message)


@pytest.mark.parametrize(
    "key, message",
    [
        ("grad_clip", "must be >= 0 (0 turns clipping off)"),
        ("timeout_s", "must be > 0"),
        ("stop_grace_s", "must be > 0"),
        ("memory_limit_mib", "must be > 0 (or null for no budget)"),
    ],
)
def test_non_finite_trainer_numbers_are_refused_nan_by_its_range_inf_as_not_finite(key, message):
    refused(lambda: config.TrainerConfig(**{key: math.inf}), f"trainer.{key}=inf must be a finite number")
    refused(lambda: config.TrainerConfig(**{key: math.nan}), f"trainer.{key}=nan {message}")


@pytest.mark.parametrize(
    "key, bad, fine, message",
    [
        ("lr", 0.0, 1e-9, "optimizer.lr=0.0 must be > 0"),
        ("lr", math.inf, 1e-9, "optimizer.lr=inf must be a finite number"),
        ("weight_decay", -0.1, 0.0, "optimizer.weight_decay=-0.1 must be a finite number >= 0"),
        ("no_decay_lr_scale", math.nan, 0.0, "optimizer.no_decay_lr_scale=nan must be a finite number >= 0"),
        ("eps", 0.0, 1e-12, "optimizer.eps=0.0 must be a finite number > 0"),
        ("momentum", 1.0, 0.0, "optimizer.momentum=1.0 must be in [0, 1)"),
        ("momentum", -0.1, 0.99, "optimizer.momentum=-0.1 must be in [0, 1)"),
    ],
)
def test_optimizer_numbers_refused_outside_their_range(key, bad, fine, message):
    config.OptimizerConfig(name="adam", **{key: fine})
    refused(lambda: config.OptimizerConfig(name="adam", **{key: bad}), message)


@pytest.mark.parametrize("betas", [[0.9], [0.9, 1.0], [-0.1, 0.9], [0.9, math.nan], [0.9, 0.99, 0.999]])
def test_betas_must_be_two_numbers_in_zero_one(betas):
    refused(
        lambda: config.OptimizerConfig(name="adam", betas=betas),
        f"optimizer.betas={betas} must be two numbers in [0, 1) (e.g. [0.9, 0.999])",
    )


def test_betas_at_zero_are_allowed():
    config.OptimizerConfig(name="adam", betas=[0.0, 0.0])


@pytest.mark.parametrize(
    "key, bad, fine, message",
    [
        ("init_scale", 0.0, 1.0, "precision.init_scale=0.0 must be > 0"),
        ("init_scale", math.inf, 1.0, "precision.init_scale=inf must be > 0"),
        ("backoff_factor", 1.0, 0.99, "precision.backoff_factor=1.0 must be in (0, 1)"),
        ("backoff_factor", 0.0, 0.01, "precision.backoff_factor=0.0 must be in (0, 1)"),
        ("growth_interval", 0, 1, "precision.growth_interval=0 must be >= 1"),
    ],
)
def test_grad_scaler_settings_refused_outside_their_range(key, bad, fine, message):
    config.PrecisionConfig(**{key: fine})
    refused(lambda: config.PrecisionConfig(**{key: bad}), message)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"params": 0.5}, "plan.params=0.5 must be a finite number >= 1 (a parameter count, e.g. 7.5e9)"),
        ({"params": math.nan}, "plan.params=nan must be a finite number >= 1"),
        ({"device_memory_gib": 0.0}, "plan.device_memory_gib=0.0 must be a finite number > 0"),
        ({"device_memory_gib": math.inf}, "plan.device_memory_gib=inf must be a finite number > 0"),
        ({"workers": -1}, "plan.workers=-1 must be >= 0 (0: one process per CPU core; 1: this process only)"),
    ],
)
def test_plan_settings_refused_outside_their_range(values, message):
    refused(lambda: config.PlanSettings(**values), message)


def test_plan_settings_at_their_edges_pass():
    config.PlanSettings(params=1.0, device_memory_gib=0.1, workers=0)


def test_plan_device_profile_names_a_profile_or_this_before_anything_is_faked():
    refused(
        lambda: config.PlanSettings(device_profile="h100"),
        "plan.device_profile=h100 is not a device profile; use one of a100_40gb, a100_80gb, h100_hbm2e_500w, "
        "h100_sxm, h200, v100_32gb, this (or null: h100_sxm for plan.device=cuda, this for cpu)",
    )
    config.PlanSettings(device_profile="this")
    config.PlanSettings(device_profile="h100_hbm2e_500w")


def test_report_device_profile_names_a_gpu_profile_or_nothing():
    refused(
        lambda: config.ReportConfig(device_profile="h100"),
        "report.device_profile=h100 is not a named GPU profile; use one of a100_40gb, a100_80gb, h100_hbm2e_500w, "
        "h100_sxm, h200, v100_32gb (or null)",
    )
    refused(lambda: config.ReportConfig(device_profile="this"), "report.device_profile=this is not a named GPU")
    config.ReportConfig(device_profile="h200")
    config.ReportConfig()
    assert OmegaConf.to_object(compose(["report.device_profile=a100_80gb"]).report).device_profile == "a100_80gb"


def test_typed_builds_the_schemas_dataclasses_and_runs_their_checks():
    cfg = compose(["logger=none"])
    made = config.typed(cfg)
    assert isinstance(made, config.Config)
    assert isinstance(made.trainer, config.TrainerConfig) and made.trainer.accelerator is config.Accelerator.auto
    cfg.trainer.grad_accum = 0  # OmegaConf takes it (an int); the dataclass refuses it
    refused(lambda: config.typed(cfg), "trainer.grad_accum=0 must be >= 1")
    refused(lambda: config.check_ranges(cfg), "trainer.grad_accum=0 must be >= 1")


@dataclasses.dataclass
class Bounded:
    """Worked by hand: width 128 in 4 heads divides; rate in (0, 1]; workers from 0."""

    name: str = "bounded"
    width: int = config.bounded(128, multiple_of="heads")
    heads: int = config.bounded(4, at_least=1)
    rate: float = config.bounded(0.5, above=0, at_most=1)
    workers: int = config.bounded(0, at_least=0)
    maybe: Optional[int] = config.bounded(None, at_least=1)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"heads": 3}, "part.width=128 is not divisible by part.heads=3"),
        ({"heads": 0}, "part.heads=0 must be >= 1 (part=bounded)"),  # the limit first: 0 divides nothing
        ({"rate": 0.0}, "part.rate=0.0 must be > 0 (part=bounded)"),
        ({"rate": 1.5}, "part.rate=1.5 must be <= 1 (part=bounded)"),
        ({"workers": -1}, "part.workers=-1 must be >= 0 (part=bounded)"),
        ({"maybe": 0}, "part.maybe=0 must be >= 1 (part=bounded)"),
    ],
)
def test_declared_bounds_refuse_naming_the_value_and_what_is_allowed(values, message):
    node = OmegaConf.merge(OmegaConf.structured(Bounded), values)
    refused(lambda: config.check_bounds("part", node, Bounded), message)
    refused(lambda: config.check_bounds("part", Bounded(**values), Bounded), message)  # a dataclass alike


def test_values_within_their_bounds_pass_and_null_or_an_interpolation_is_left_alone():
    for values in ({}, {"width": 96, "heads": 3}, {"rate": 1.0}, {"maybe": None}, {"workers": 0}):
        config.check_bounds("part", OmegaConf.merge(OmegaConf.structured(Bounded), values), Bounded)
    node = OmegaConf.structured(Bounded)
    node.heads = "${oc.env:SHARDED_EXP_SURELY_UNSET,3}"  # resolved: 3 divides 128? no: refused
    refused(lambda: config.check_bounds("part", node, Bounded), "part.width=128 is not divisible by part.heads=3")
    with pytest.raises(TypeError, match="between"):
        config.bounded(1, between=(0, 2))


def test_check_ranges_holds_the_bounds_the_registries_schemas_declare_and_a_models_sizes():
    refused(lambda: config.check_ranges(compose(["model=gpt", "model.n_heads=3"])),
            "model.d_model=128 is not divisible by model.n_heads=3")  # fmt: skip
    refused(lambda: config.check_ranges(compose(["strategy=fsdp", "strategy.replicate=0"])),
            "strategy.replicate=0 must be >= 1 (strategy=fsdp)")  # fmt: skip
    refused(lambda: config.check_ranges(compose(["model.depth=0"])), "model.depth=0 must be >= 1 (model=mlp)")
    config.check_ranges(compose(["model.depth=1"]))


def test_a_value_that_must_divide_the_world_size_is_held_where_the_world_size_is_known():
    cfg = compose(["strategy=fsdp", "strategy.replicate=3", "trainer.world_size=4"])
    refused(lambda: config.check_ranges(cfg, world_size=4),
            "strategy.replicate=3 must divide trainer.world_size=4 (HSDP: replica groups of equal size; "
            "divisors: 1, 2, 4)")  # fmt: skip
    config.check_ranges(cfg)  # no world size known (a plan of others): not held here
    config.check_ranges(cfg, world_size=6)  # torchrun's 6 ranks, not the config's 4: 3 divides it
    config.check_ranges(compose(["strategy=fsdp", "strategy.replicate=2"]), world_size=4)


def test_a_model_size_below_one_is_refused_naming_the_model():
    config.check_model_sizes({"name": "mlp", "depth": 1, "dropout_free": True})
    refused(lambda: config.check_model_sizes({"name": "mlp", "depth": 0}), "model.depth=0 must be >= 1 (model=mlp)")
    node = OmegaConf.create({"name": "hf_gpt2", "seq_len": 0, "config": {"n_embd": "???"}, "_target_": "???"})
    refused(lambda: config.check_model_sizes(node), "model.seq_len=0 must be >= 1 (model=hf_gpt2)")  # ??? skipped
    from sharded_exp.models.gpt import GPTConfig

    refused(lambda: config.check_model_sizes(GPTConfig(n_layers=0)), "model.n_layers=0 must be >= 1 (model=gpt)")


def test_a_model_with_a_missing_value_still_has_its_sizes_and_bounds_held():
    """The planner's check_values on a Hugging Face model whose config is incomplete."""
    cfg = compose(["model=hf_gpt2", "model.seq_len=0", "model.config.n_embd=???"])
    refused(lambda: config.check_ranges(cfg), "model.seq_len=0 must be >= 1 (model=hf_gpt2)")


def test_a_schema_that_redefines_a_bounded_field_keeps_its_bounds():
    """A subclass's field replaces its base's, metadata and all: a registry schema that
    redefines a bounded field (a default of its own) must declare the bounds again."""
    from sharded_exp.compose import registry_schemas

    for name, cls in registry_schemas(query=False).items():
        ours = {f.name: f.metadata.get("bounds") for f in dataclasses.fields(cls)}
        for base in cls.__mro__[1:]:
            if dataclasses.is_dataclass(base):
                for f in dataclasses.fields(base):
                    if f.metadata.get("bounds"):
                        assert ours.get(f.name), f"{name}: {f.name} is bounded in {base.__name__}, not here"


def test_check_ranges_leaves_a_group_with_a_missing_value_to_its_reader():
    cfg = compose(["logger=none", "model=hf_bert", "data=conll", "trainer.grad_accum=0"])
    assert OmegaConf.is_missing(cfg.data, "path")
    refused(lambda: config.check_ranges(cfg), "trainer.grad_accum=0 must be >= 1")  # the others are checked
    cfg.trainer.grad_accum = 1
    config.check_ranges(cfg)  # data is skipped, not refused as "missing mandatory value"


def test_a_typed_config_is_read_only_from_typed_to_the_ranks():
    """Every schema derives from Sealed; typed() seals the whole tree: a field cannot be set,
    pickling (the JobSpec's way to a spawned rank) and deepcopy keep it sealed, and
    dataclasses.replace makes a changed, unsealed copy."""
    import copy
    import dataclasses
    import pickle

    from sharded_exp.compose import compose, registry_schemas
    from sharded_exp.config import Sealed, typed

    schemas = [node for node in registry_schemas(None).values() if isinstance(node, type)]
    assert schemas and all(issubclass(node, Sealed) for node in schemas), [
        n for n in schemas if not issubclass(n, Sealed)
    ]
    cfg = typed(compose(["strategy=fsdp"]))
    for obj, field in ((cfg.trainer, "steps"), (cfg.strategy, "reshard_after_forward"), (cfg, "trainer")):
        with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
            setattr(obj, field, getattr(obj, field))
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            again.trainer.steps = 3
    changed = dataclasses.replace(cfg.trainer, steps=cfg.trainer.steps + 10)
    changed.steps += 1  # a copy made by replace is the caller's own
    assert changed.steps == cfg.trainer.steps + 11


def test_a_missing_model_field_is_refused_naming_the_task_and_the_fields():
    model = OmegaConf.create({"name": "mlp", "in_features": 4})
    config.require_model_fields("teacher", "classifiers", model, ("in_features",))
    with pytest.raises(ConfigError) as err:
        config.require_model_fields(
            "markov", "language models (model=gpt)", model, ("vocab_size", "seq_len", "in_features")
        )
    assert str(err.value) == (
        "data=markov feeds language models (model=gpt), not model=mlp: it needs model.vocab_size, model.seq_len, "
        "model.in_features (model=mlp has no vocab_size, seq_len)"
    )


def test_check_ranges_refuses_a_model_the_data_task_does_not_feed():
    refused(lambda: config.check_ranges(compose(["model=gpt", "data=teacher"])),
            "data=teacher feeds classifiers (model=mlp), not model=gpt: it needs model.in_features, model.num_classes")  # fmt: skip
    refused(lambda: config.check_ranges(compose(["data=markov"])), "data=markov feeds language models (model=gpt)")
    config.check_ranges(compose(["model=gpt"]))  # its own task (markov): fed


def test_a_tasks_builder_refuses_a_model_it_cannot_feed_from_a_plain_config_too():
    """A rank's config is plain data (no schema type to read the task's needs from): the
    builder names its own class."""
    from sharded_exp.data import TASKS  # lazy: the builders import torch

    plain = OmegaConf.create({"name": "teacher", "seed": 1, "teacher_hidden": 4})
    gpt = OmegaConf.create({"name": "gpt", "vocab_size": 16, "seq_len": 8})
    refused(
        lambda: TASKS.builder("teacher")(plain, gpt, 2), "data=teacher feeds classifiers (model=mlp), not model=gpt"
    )
    refused(lambda: TASKS.builder("causal_lm")(OmegaConf.create({"name": "causal_lm", "seed": 1, "branching": 2}),
                                                OmegaConf.create({"name": "mlp", "in_features": 4}), 2),
            "data=causal_lm feeds causal language models (model=hf_gpt2), not model=mlp")  # fmt: skip


def test_a_file_dataset_is_held_to_what_it_feeds_per_kind():
    """text_file feeds causal language models, conll token classifiers, hf_dataset either by
    its data.kind: declared on their classes, held before the file is read."""
    files = ["data.path=/no/such/file", "data.tokenizer=/no/such/dir"]
    refused(lambda: config.check_ranges(compose(["model=mlp", "data=text_file", *files])),
            "data=text_file feeds causal language models (model=hf_gpt2, hf_llama), not model=mlp")  # fmt: skip
    refused(lambda: config.check_ranges(compose(["model=gpt", "data=conll", *files])),
            "data=conll feeds token classifiers (model=hf_bert), not model=gpt: it needs model.vocab_size, "
            "model.seq_len, model.num_labels (model=gpt has no num_labels)")  # fmt: skip
    token = ["data=hf_dataset", "data.kind=token_classification", *files]
    refused(lambda: config.check_ranges(compose(["model=gpt", *token])), "data=hf_dataset feeds token classifiers")
    config.check_ranges(compose(["model=gpt", "data=hf_dataset", *files]))  # kind=causal_lm: gpt has its fields
    config.check_ranges(compose(["model=hf_bert", *token]))


def test_a_task_declaring_fields_but_not_its_models_is_still_said_in_words():
    class Partial:
        MODEL_FIELDS = ("vocab_size",)
        name = "mine"

    refused(lambda: config.check_fed(Partial(), OmegaConf.create({"name": "mlp"})),
            "data=mine feeds the models that have these fields, not model=mlp: it needs model.vocab_size")  # fmt: skip
