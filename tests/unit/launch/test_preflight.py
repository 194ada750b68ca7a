"""sharded_exp.launch.preflight, its pure parts: every refusal made before any rank starts
(each naming the bad value and what is allowed), the device decision, the host-memory
check, and the JobSpec that check() decides (world size, launcher, decided config)."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError, WontFit
from sharded_exp.launch import preflight
from sharded_exp.launch.layout import Layout
from sharded_exp.launch.preflight import (
    RANK_OVERHEAD_MIB,
    check,
    check_host_memory,
    check_values,
    decide_device,
    host_need_mib,
)

SMALL = ["logger=none", "model.hidden=16", "model.depth=2", "trainer.batch_size=4"]


@pytest.fixture(scope="module")
def composed():
    return compose(SMALL)


@pytest.fixture
def cfg(composed):
    return copy.deepcopy(composed)


def refused(cfg, message: str, fn=check_values):
    with pytest.raises(ConfigError, match=re.escape(message)):
        fn(cfg)


def test_the_default_config_passes_every_check(cfg):
    check_values(cfg)


@pytest.mark.parametrize(
    "group, key, bad, message",
    [
        ("trainer", "steps", 0, "trainer.steps=0 must be >= 1"),
        ("trainer", "warmup_steps", 35, "trainer.warmup_steps=35 must be >= 0 and < trainer.steps=35"),
        ("trainer", "timeout_s", math.inf, "trainer.timeout_s=inf must be a finite number"),
        ("optimizer", "lr", 0.0, "optimizer.lr=0.0 must be > 0"),
        ("precision", "growth_interval", 0, "precision.growth_interval=0 must be >= 1"),
    ],
)
def test_each_groups_own_range_checks_run_when_check_values_makes_the_config_typed(cfg, group, key, bad, message):
    """The checks live on the schemas (tests/unit/test_config.py has each one); check_values runs them."""
    cfg[group][key] = bad
    refused(cfg, message)


def test_the_spec_carries_the_decided_config_typed(cfg, tmp_path):
    from sharded_exp.config import Config, TrainerConfig, ZeroGrad

    spec = check(cfg, str(tmp_path), peak=False)
    assert isinstance(spec.typed, Config) and isinstance(spec.typed.trainer, TrainerConfig)
    assert spec.cfg().trainer.zero_grad is ZeroGrad.free and spec.config["trainer"]["zero_grad"] == "free"


def _composed_from_the_cache(overrides: list[str]):
    """The config as the command line composes it: the registries' schemas made again from
    their cache file (no torch there), then plain data for the trip to the check's process."""
    import pickle

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sharded_exp.compose import CONF_DIR, plain_registry_groups, register_schemas, registry_schemas

    registry_schemas(query=True)  # the cache file written, if this machine has none it can read
    try:
        register_schemas(query=True)
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose("config", overrides=overrides)
        assert OmegaConf.get_type(cfg.strategy).__module__ != "sharded_exp.strategies.fsdp"  # made again
        return cfg, pickle.loads(pickle.dumps(plain_registry_groups(cfg)))
    finally:
        register_schemas()  # the registries' own classes again, for the tests after this one


def test_groups_composed_from_the_cached_schemas_reach_the_check_plain_and_leave_it_typed(tmp_path):
    """The check makes each registry group of its real schema again, so that the schema's own
    range checks run and the ranks get the registry's dataclass; enum values and an
    interpolation between two enum fields come through as composed, and a key added on the
    command line that nothing reads is refused, plain or made again."""
    from sharded_exp.models.mlp import MLPConfig
    from sharded_exp.strategies.fsdp import DType, FSDPConfig

    made, plain = _composed_from_the_cache(["strategy=fsdp", "precision=bf16", "strategy.param_dtype=bfloat16",
                                            "strategy.reduce_dtype=${strategy.param_dtype}", *SMALL])  # fmt: skip
    assert OmegaConf.get_type(plain.strategy) is dict and OmegaConf.get_type(plain.model) is dict
    # sent to the rank server (plain), or checked where it was composed (torchrun, srun: made again)
    for cfg in (plain, made):
        spec = check(cfg, str(tmp_path), peak=False)
        assert isinstance(spec.typed.strategy, FSDPConfig) and isinstance(spec.typed.model, MLPConfig)
        assert spec.typed.strategy.param_dtype is DType.bfloat16 and spec.typed.strategy.reduce_dtype is DType.bfloat16
    added, plain_added = _composed_from_the_cache(["+model.note=mine", *SMALL])
    for cfg in (plain_added, added):
        refused(cfg, "model.note is not a setting of model=mlp, and nothing would read it (its settings: in_features")
    plain.model.depth = "many"  # plain data takes anything: the real schema does not
    refused(plain, "model.depth: Value 'many' of type 'str' could not be converted to Integer")


def test_a_key_added_that_nothing_reads_is_refused_in_every_group_but_a_model_of_your_own(cfg):
    """``+trainer.stepz=3`` ran to the end with the steps unchanged: a typo with a plus. Each
    group's schema names what is read; a model built by ``_target_`` takes added keys as its
    builder's arguments."""
    for group, key, meant in (("trainer", "stepz", "steps"), ("optimizer", "momentun", "momentum"),
                              ("precision", "init_scal", "init_scale"), ("strategy", "bucket_cap", None),
                              ("data", "seq", None), ("logger", "projct", "project")):  # fmt: skip
        bad = copy.deepcopy(cfg)
        with open_dict(bad[group]):
            bad[group][key] = 3
        refused(bad, f"{group}.{key} is not a setting of ")
        if meant:
            refused(bad, f"and nothing would read it; did you mean {group}.{meant}?")
    mine = compose(["model=custom", "model._target_=tests.helpers.user_models.build", "+model.hidden=24", *SMALL[:1]])
    check_values(mine)  # its builder's argument


def test_unknown_names_are_refused_naming_the_choices(cfg):
    bad = copy.deepcopy(cfg)
    bad.strategy.name = "zero9"
    refused(bad, "unknown strategy 'zero9'; registered: ddp, fsdp, fsdp_grad_op, oss, sharded_ddp, zero1")
    bad = copy.deepcopy(cfg)
    bad.precision.name = "8"
    refused(bad, "precision='8' is not one of 32, 16, bf16")
    bad = copy.deepcopy(cfg)
    bad.optimizer.name = "lamb"
    refused(bad, "optimizer.name='lamb' is not one of adam, adamw, sgd")
    bad = copy.deepcopy(cfg)
    bad.data.name = "imagenet"
    refused(bad, "unknown data 'imagenet'; registered:")


def test_a_key_the_strategy_does_not_have_is_refused_naming_its_settings():
    cfg = compose([*SMALL, "+strategy.bucket_size=3"])
    with pytest.raises(ConfigError) as err:
        check_values(cfg)
    assert "strategy.bucket_size is not a setting of strategy=ddp" in str(err.value)
    assert "its settings: " in str(err.value) and "name" not in str(err.value).split("its settings: ")[1].split(", ")


def test_a_model_size_below_one_is_refused_naming_the_model(cfg):
    cfg.model.depth = 0  # the rule is config.check_model_sizes (tests/unit/test_config.py); check_values runs it
    refused(cfg, "model.depth=0 must be >= 1 (model=mlp)", check_values)


def test_a_malformed_fault_variable_is_refused_as_a_config_error(cfg, monkeypatch):
    monkeypatch.setenv("SHARDED_EXP_FAULT", "explode@rank=x")
    with pytest.raises(ConfigError):
        check_values(cfg)


@pytest.mark.parametrize(
    "precision, param_dtype, ok",
    [
        ("32", "bfloat16", True),  # param_dtype alone sets the compute dtype
        ("bf16", "bfloat16", True),
        ("16", "float16", True),
        ("16", "float32", True),
        ("16", None, True),
        ("16", "bfloat16", False),
        ("bf16", "float16", False),
    ],
)
def test_fsdp_param_dtype_must_be_autocasts_dtype(precision, param_dtype, ok):
    cfg = compose(["strategy=fsdp", f"precision={precision}", f"strategy.param_dtype={param_dtype or 'null'}"])
    if ok:
        preflight._check_param_dtype(cfg)
    else:
        half = {"16": "float16", "bf16": "bfloat16"}[precision]
        with pytest.raises(ConfigError, match=re.escape(f"use strategy.param_dtype={half}")):
            preflight._check_param_dtype(cfg)


# ------------------------------------------------------------------------ the device
def _cuda(monkeypatch, available: bool, count: int = 0):
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(preflight.torch.cuda, "device_count", lambda: count)


def test_cpu_is_chosen_when_asked_or_when_cuda_is_missing(monkeypatch):
    _cuda(monkeypatch, True, 8)
    assert decide_device("cpu", 4, "32") == "cpu"
    _cuda(monkeypatch, False)
    assert decide_device("auto", 4, "32") == "cpu"


def test_gpu_without_cuda_is_refused(monkeypatch):
    _cuda(monkeypatch, False)
    with pytest.raises(ConfigError, match="trainer.accelerator=gpu but CUDA is not available here"):
        decide_device("gpu", 1, "32")


def test_one_gpu_per_local_rank_is_needed(monkeypatch):
    _cuda(monkeypatch, True, 2)
    assert decide_device("auto", 2, "32") == "cuda"
    with pytest.raises(ConfigError, match=re.escape("trainer.world_size=3 is more than the 2 GPU(s) present")):
        decide_device("gpu", 3, "32")


def test_an_external_launcher_may_give_each_task_its_one_gpu(monkeypatch):
    _cuda(monkeypatch, True, 1)
    assert decide_device("gpu", 4, "32", per_task=True) == "cuda"
    with pytest.raises(ConfigError):
        decide_device("gpu", 4, "32", per_task=False)
    _cuda(monkeypatch, True, 2)
    with pytest.raises(ConfigError):
        decide_device("gpu", 4, "32", per_task=True)  # two GPUs shared by four tasks


# ------------------------------------------------------------------- host memory
def test_host_memory_counts_the_largest_peaks_of_the_local_ranks_plus_their_processes(monkeypatch):
    per_rank = [100.0, 300.0, 200.0, 50.0]
    need = 300 + 200 + 2 * RANK_OVERHEAD_MIB  # two ranks here: the two largest peaks
    check_host_memory(per_rank, 2, need)  # exactly enough
    with pytest.raises(WontFit, match=re.escape(f"needs about {need:,.0f} MiB of host memory (2 rank(s): predicted")):
        check_host_memory(per_rank, 2, need - 1)
    with pytest.raises(WontFit, match=re.escape("(2 rank(s): model states alone 300.0 MiB each")):
        check_host_memory(per_rank, 2, need - 1, "model states alone")


def test_the_host_holds_every_tensor_on_cpu_and_only_offloaded_states_on_a_gpu():
    peak = {"per_rank_mib": [900.0, 800.0], "host_mib": None}
    assert host_need_mib(peak, "cpu") == [900.0, 800.0]
    assert host_need_mib(peak, "cuda") is None  # nothing offloaded: the GPU holds it, not checked here
    offloaded = {"per_rank_mib": [900.0, 800.0], "host_mib": [4096.0, 4000.0]}
    assert host_need_mib(offloaded, "cuda") == [4096.0, 4000.0]


def test_host_memory_is_not_checked_without_a_prediction_or_a_reading():
    check_host_memory(None, 2, 1.0)
    check_host_memory([], 2, 1.0)
    check_host_memory([1e9], 2, None)


# ------------------------------------------------------------------------- check()
def test_check_decides_a_job_spec_and_leaves_the_config_unchanged(composed, tmp_path):
    before = OmegaConf.to_yaml(composed)
    spec = check(composed, str(tmp_path / "run"), peak=False)
    assert OmegaConf.to_yaml(composed) == before
    assert (spec.world_size, spec.launcher, spec.device_type) == (2, "spawn", "cpu")
    assert spec.config["trainer"]["checkpoint_dir"] == str(tmp_path / "run" / "checkpoints")
    assert spec.config["trainer"]["checkpoint_format"] == "consolidated"  # ddp's auto
    assert spec.config["trainer"]["accelerator"] == "auto"  # a plain name, not an enum
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize(
    "overrides, early",
    [
        ([], True),
        (["trainer.checkpoint_every=2"], False),  # holds and tidies a checkpoint directory before the peak
        (["strategy=fsdp"], True),
        (["strategy=fsdp", "+offload"], False),  # (on a GPU) pins its states in host memory as it builds
    ],
)
def test_the_ranks_start_while_the_peak_is_predicted_only_where_they_touch_nothing_outside_the_run(
    overrides, early, tmp_path
):
    from sharded_exp.launch.preflight import starts_early

    offload = "+offload" in overrides
    spec = check(compose([*SMALL, *(o for o in overrides if o != "+offload")]), str(tmp_path / "run"), peak=False)
    if offload:  # refused on CPU, where the states are in host memory already: the GPU job's spec
        strategy = {**spec.config["strategy"], "cpu_offload": True}
        spec = dataclasses.replace(spec, config={**spec.config, "strategy": strategy}, device_type="cuda")
    assert starts_early(spec) is early


def test_check_takes_the_world_size_and_launcher_of_an_external_layout(composed, tmp_path):
    spec = check(composed, str(tmp_path), layout=Layout(0, 3, 0, 3, "torchrun"), peak=False)
    assert spec.world_size == 3 and spec.launcher == "torchrun"
    assert spec.config["trainer"]["world_size"] == 3
    assert "world_size: 3" in spec.config_yaml


def test_check_counts_the_models_parameters(composed, tmp_path):
    cfg = composed.model  # MLP: in -> hidden (depth-1 times hidden -> hidden) -> classes, with biases
    spec = check(composed, str(tmp_path), peak=False)
    h, i, c, d = cfg.hidden, cfg.in_features, cfg.num_classes, cfg.depth
    assert spec.params >= (i * h + h) + (d - 1) * (h * h + h) + (h * c + c) - 1  # at least the linear layers


def test_freezing_every_parameter_is_refused(composed, tmp_path):
    cfg = copy.deepcopy(composed)
    cfg.trainer.freeze = ["*"]
    with pytest.raises(ConfigError, match=re.escape("trainer.freeze=['*'] freezes every parameter of model=mlp")):
        check(cfg, str(tmp_path), peak=False)


@pytest.mark.parametrize("overrides, message", [
    (["model=hf_llama", "model.config.num_key_value_heads=3"],
     "model.config.num_attention_heads=4 is not divisible by model.config.num_key_value_heads=3 (model=hf_llama)"),
    (["model=hf_llama", "model.config.num_attention_heads=3"],
     "model.config.hidden_size=128 is not divisible by model.config.num_attention_heads=3 (model=hf_llama)"),
    (["model=hf_gpt2", "model.config.n_head=5"], "model.config.n_embd="),
])  # fmt: skip
def test_hugging_face_head_counts_that_do_not_divide_are_refused_before_any_rank(overrides, message):
    from sharded_exp.compose import compose
    from sharded_exp.errors import ConfigError
    from sharded_exp.launch import preflight

    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.check_values(compose(overrides))


# ------------------------------------------------------------- models FSDP cannot wrap
class _Blocks(torch.nn.Module):
    def __init__(self, blocks, head=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head if head is not None else torch.nn.Linear(4, 2)

    def sharding_units(self):
        return list(self.blocks)


def test_a_block_reused_as_two_units_is_refused_for_fsdp():
    from sharded_exp.errors import ConfigError
    from sharded_exp.launch.preflight import check_units_shardable

    block = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"strategy=fsdp: model=mine's unit blocks.0 is listed twice"):
        check_units_shardable(_Blocks([block, block]), "mine", "fsdp")


def test_a_weight_tied_across_units_or_to_the_root_is_refused_for_fsdp():
    from sharded_exp.errors import ConfigError
    from sharded_exp.launch.preflight import check_units_shardable

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(
        ConfigError, match=r"parameter blocks.1.weight is also blocks.0.weight \(one tensor in two units\)"
    ):
        check_units_shardable(_Blocks([a, b]), "mine", "fsdp")
    c = torch.nn.Linear(4, 4)
    head = torch.nn.Linear(4, 4)
    head.weight = c.weight
    with pytest.raises(ConfigError, match=r"parameter head.weight is also blocks.0.weight \(a unit's tensor tied"):
        check_units_shardable(_Blocks([c], head), "mine", "fsdp")
    check_units_shardable(_Blocks([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]), "mine", "fsdp")  # sound


def test_nested_units_are_refused_for_fsdp():
    from sharded_exp.errors import ConfigError
    from sharded_exp.launch.preflight import check_units_shardable

    class Nested(_Blocks):
        def sharding_units(self):
            return [self.blocks[0], self.blocks[0][0]]

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"unit blocks.0.0 is inside its unit blocks.0: FSDP's units must not nest"):
        check_units_shardable(Nested([inner]), "mine", "fsdp")


def test_a_lazy_module_is_refused_naming_its_parameter():
    from sharded_exp.errors import ConfigError
    from sharded_exp.launch.preflight import check_no_lazy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyLinear(2))
    with pytest.raises(ConfigError, match=r"model=mine: parameter 1.weight \(LazyLinear\) has no shape until a first"):
        check_no_lazy(model, "mine")


def test_a_model_whose_constructor_reads_a_value_is_built_on_the_host_for_its_shapes(tmp_path):
    from sharded_exp.compose import compose
    from sharded_exp.launch import preflight
    from sharded_exp.predict.prediction import meta_model

    cfg = compose(["model=custom", "model._target_=tests.helpers.user_models.build_reading_a_value"])
    with pytest.raises(Exception, match="meta"):
        meta_model(cfg.model)  # what refused it before
    module = preflight.shapes_model(cfg)
    assert module.scale.item() > 0 and all(p.device.type == "cpu" for p in module.parameters())


def test_pre_flight_refuses_a_package_a_strategy_states_in_its_traits_only(monkeypatch):
    import dataclasses

    from sharded_exp.strategies.ddp import DDP

    monkeypatch.setattr(DDP, "traits", dataclasses.replace(DDP.traits, requires=("no_such_package_xyz",)))
    with pytest.raises(ConfigError, match="strategy=ddp needs the package.s. no_such_package_xyz, which are not"):
        preflight.check_values(compose([]))
