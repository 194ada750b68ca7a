"""The real config tree: every group option composes; bad input fails early and clearly."""

from __future__ import annotations

import re

import pytest
import torch
from hydra.errors import ConfigCompositionException

from sharded_exp.compose import compose, quote_numeric_choices
from sharded_exp.errors import ConfigError
from sharded_exp.launch import preflight
from sharded_exp.registry import Registry
from tests.helpers.jobs import ROOT, STRATEGY_NAMES, TINY, launch_job, run_cli, tiny
from tests.helpers.runs import cli


def validate(cfg, tmp_path="/nonexistent-output-dir") -> int:
    """The parent's pre-flight on a composed config; the parameter count it found."""
    return preflight.check(cfg, str(tmp_path)).params


@pytest.mark.parametrize(
    "overrides",
    [
        [f"strategy={s}", f"precision={p}", f"model={m}", f"optimizer={o}"]
        for s in STRATEGY_NAMES
        for p in ("32", "16", "bf16")
        for m in ("mlp", "gpt")
        for o in ("adam", "adamw", "sgd")
    ][::7],  # a spread of the 54 combinations; each group option appears
)
def test_group_options_compose_and_validate(overrides):
    cfg = compose(overrides)
    assert validate(cfg) > 0
    assert cfg.data.name == {"mlp": "teacher", "gpt": "markov"}[cfg.model.name]


def test_every_option_of_every_group_composes():
    for group, options in {
        "strategy": STRATEGY_NAMES,
        "precision": ["32", "16", "bf16"],
        "model": [
            "mlp",
            "gpt",
            "hf_bert",
            "hf_bert_base",
            "hf_bert_base_multilingual",
            "hf_gpt2",
            "hf_gpt2_small",
            "hf_gpt2_xl",
            "hf_llama",
            "hf_llama_7b",
            "custom",
        ],
        "optimizer": ["adam", "adamw", "sgd"],
        "data": ["teacher", "markov", "token_classification", "causal_lm"],
    }.items():
        for option in options:
            cfg = compose([f"{group}={option}"])
            assert str(cfg[group].name) == option


def test_precision_16_is_a_group_choice():
    assert quote_numeric_choices(["precision=16", "trainer.steps=3", "precision=32,16", "precision=8"]) == [
        "precision=fp16",
        "trainer.steps=3",
        "precision=fp32,fp16",
        "precision='8'",  # no such option: Hydra says so (not "must be a string")
    ]
    assert compose(["precision=16"]).precision.name == "16"


@pytest.mark.parametrize(
    "override, error",
    [
        ("trainer.stepz=3", ConfigCompositionException),  # typo in a key
        ("trainer.world_size=abc", ConfigCompositionException),  # wrong type
        ("trainer.accelerator=tpu", ConfigCompositionException),  # not an allowed value
        ("trainer.zero_grad=none", ConfigCompositionException),  # free or zeros
        ("optimizer.foreach=sometimes", ConfigCompositionException),  # true, false or null
        ("strategy.bucket_cap_mb=big", ConfigCompositionException),
        ("strategy=nope", ConfigCompositionException),  # unknown group option
        ("model=resnet", ConfigCompositionException),
    ],
)
def test_composition_rejects(override, error):
    with pytest.raises(error):
        compose([override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.world_size=0"], "trainer.world_size=0 must be >= 1"),
        (["trainer.batch_size=0"], "trainer.batch_size=0 must be >= 1"),
        (["trainer.steps=0"], "trainer.steps=0 must be >= 1"),
        (["trainer.steps=5", "trainer.warmup_steps=5"], "trainer.warmup_steps=5"),
        (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be >= 0"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["model=gpt", "model.n_heads=3"], "model.d_model=128 is not divisible by model.n_heads=3"),
        (["model=gpt", "data=teacher"], "data=teacher feeds classifiers"),
        (
            ["strategy.name=zero9"],
            "unknown strategy 'zero9'; registered: ddp, fsdp, fsdp_grad_op, oss, sharded_ddp, zero1",
        ),
        (["precision.name=8"], "precision='8' is not one of 32, 16, bf16"),
        (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every=-1 must be >= 0 (0 = off)"),
        (["trainer.keep_checkpoints=-2"], "trainer.keep_checkpoints=-2 must be >= 0 (0 = keep all)"),
        (["trainer.stop_grace_s=0"], "trainer.stop_grace_s=0.0 must be > 0"),
        (["trainer.timeout_s=0"], "trainer.timeout_s=0.0 must be > 0"),
        (["trainer.memory_limit_mib=-5"], "trainer.memory_limit_mib=-5.0 must be > 0"),
        (["trainer.profile_steps=0"], "trainer.profile_steps=0 must be >= 1"),
        (
            ["trainer.profile=true", "trainer.steps=6", "trainer.warmup_steps=3", "trainer.profile_steps=3"],
            "trainer.profile_steps=3 needs trainer.steps=6 > trainer.warmup_steps=3 + profile_steps",
        ),
    ],
)
def test_validate_rejects(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose(overrides))


def test_gpu_requested_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.accelerator=gpu but CUDA is not available"):
        validate(compose(["trainer.accelerator=gpu"]))


def test_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"trainer.world_size=2 is more than the 1 GPU\(s\) present"):
        validate(compose(["trainer.accelerator=gpu", "trainer.world_size=2"]))


def test_auto_accelerator_with_more_ranks_than_gpus_fails_before_spawn(monkeypatch):
    # trainer.accelerator=auto (the default) picks the GPUs when CUDA is there: the same check.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"trainer.world_size=2 is more than the 1 GPU\(s\) present"):
        validate(compose(["trainer.world_size=2"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert preflight.check(compose(["trainer.world_size=2"]), "/nonexistent").device_type == "cuda"
    assert preflight.check(compose(["trainer.accelerator=cpu"]), "/nonexistent").device_type == "cpu"


def test_registry_rejects_duplicates_and_names_choices():
    reg = Registry("widget")
    reg.register("a", config=dict)(lambda: None)
    with pytest.raises(KeyError, match="registered twice"):
        reg.register("a", config=dict)(lambda: None)
    with pytest.raises(ConfigError, match="unknown widget 'b'; registered: a"):
        reg.builder("b")


@pytest.mark.parametrize(
    "args, message",
    [
        (["trainer.world_size=0"], "trainer.world_size=0 must be >= 1"),
        (["trainer.accelerator=gpu"], "CUDA is not available"),
        (["strategy=nope"], "strategy=nope is not an option of strategy"),
        (["precision=8"], "precision=8 is not an option of precision"),
        (["+trainer.stepz=3"], "trainer.stepz is not a setting of trainer, and nothing would read it"),
    ],
)
@pytest.mark.slow
def test_cli_bad_input_exits_nonzero_before_ranks_start(args, message, tmp_path):
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "result.json").exists()  # no rank ever ran


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["trainer.wold_size=4"],
            "error: trainer.wold_size is not a setting of this config; did you mean trainer.world_size?",
        ),
        (["-m", "strategy=ddp,fdsp"], "error: strategy=fdsp is not an option of strategy; did you mean strategy=fsdp?"),
        # a registry schema's bound (sharded_exp.config.bounded), carried by the schema cache
        (["model=gpt", "model.n_heads=3"], "error: model.d_model=128 is not divisible by model.n_heads=3"),
        (
            ["strategy=ddp", "strategy.bucket_cap_mb=-1"],
            "error: strategy.bucket_cap_mb=-1.0 must be >= 0 (strategy=ddp)",
        ),
        (
            ["model=hf_llama", "model.config.num_attention_heads=7"],
            "error: model.config.hidden_size=128 is not divisible by model.config.num_attention_heads=7",
        ),  # fmt: skip
        # a data task's declared needs (sharded_exp.config.check_fed), carried by the cache too
        (["model=gpt", "data=teacher"], "error: data=teacher feeds classifiers (model=mlp), not model=gpt"),
        (
            ["model=mlp", "data=text_file", "data.path=corpus.txt", "data.tokenizer=tok"],
            "error: data=text_file feeds causal language models (model=hf_gpt2, hf_llama), not model=mlp",
        ),
        # a value that must divide the job's world size (a bound of kind divides_world_size)
        (
            ["strategy=fsdp", "strategy.replicate=3", "trainer.world_size=4"],
            "error: strategy.replicate=3 must divide trainer.world_size=4 (HSDP: replica groups of equal size; "
            "divisors: 1, 2, 4)",
        ),
    ],
)
def test_a_typo_or_a_value_out_of_range_is_refused_before_torch_is_imported(args, said, tmp_path):
    # The modules the refusing process had imported at its exit show torch never was: the refusal
    # comes from the config alone, in about a second (issue 48), not after the registries load;
    # their schemas come from the cache file, written here as by any command run since the install.
    # (The rank server, started first, imports torch meanwhile in a process of its own, stopped at the exit.)
    from sharded_exp.compose import registry_schemas

    registry_schemas()
    modules = tmp_path / "modules.txt"
    proc = run_cli(
        [str(modules), "sharded_exp", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},
        module="tests.helpers.modules_at_exit",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines == [lines[0]] and lines[0].startswith(said), lines
    imported = set(modules.read_text().split())
    assert "hydra" in imported and "sharded_exp.launch.forkserver" in imported and "torch" not in imported
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize(
    "fault, message",
    [
        ("rank=1,step=3,kind=explode", "SHARDED_EXP_FAULT kind='explode' is not one of raise, exit, hang, oom"),
        ("rank=1,kind=raise", "SHARDED_EXP_FAULT='rank=1,kind=raise' is not of the form rank=R,step=S,kind=K"),
    ],
)
def test_malformed_fault_is_rejected_before_ranks_start(monkeypatch, fault, message):
    monkeypatch.setenv("SHARDED_EXP_FAULT", fault)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose([]))


def test_bf16_is_checked_on_the_ranks_own_gpu_without_emulation(monkeypatch):
    from sharded_exp.launch.rank import check_bf16

    asked = []

    def supported(including_emulation=True):
        asked.append(including_emulation)
        return including_emulation  # a V100: bf16 only emulated

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(RuntimeError, match=r"precision=bf16 is not supported natively by GPU 1 \(Tesla V100"):
        check_bf16("bf16", torch.device("cuda", 1))
    assert asked == [False]
    check_bf16("16", torch.device("cuda", 1))  # other precisions ask nothing
    assert asked == [False]


def test_a_gpu_per_task_is_accepted_from_an_external_launcher(monkeypatch):
    from sharded_exp.launch.preflight import decide_device
    from sharded_exp.launch.rank import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1: one visible GPU
    assert decide_device("auto", 4, "32", per_task=True) == "cuda"
    assert rank_device(3) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"trainer.world_size=4 is more than the 1 GPU\(s\) present"):
        decide_device("auto", 4, "32")  # spawning 4 ranks ourselves onto one GPU: refused
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_device(3) == torch.device("cuda", 3)


def test_schema_cache_holds_every_registry_schema_with_its_defaults(tmp_path, monkeypatch):
    """The schemas the command line composes with, made again from the cache, have the
    registries' dataclasses' fields and defaults; a corrupt cache falls back to the registries."""
    from omegaconf import OmegaConf

    from sharded_exp.compose import registry_schemas, schemas_cache_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    typed = registry_schemas(query=False)
    path = schemas_cache_file()
    cached = registry_schemas(query=True)
    assert set(cached) == set(typed) and "schema_strategy_fsdp" in cached
    for name, cls in typed.items():
        made = OmegaConf.to_container(OmegaConf.structured(cached[name]), enum_to_str=True)
        assert made == OmegaConf.to_container(OmegaConf.structured(cls), enum_to_str=True), name
        assert cached[name].__name__ == cls.__name__
    with open(path, "w") as f:
        f.write("{not json")
    assert registry_schemas(query=True)["schema_strategy_fsdp"] is typed["schema_strategy_fsdp"]
    monkeypatch.setenv("SHARDED_EXP_PLUGINS", "tests.helpers.user_models")
    assert schemas_cache_file() is None  # out-of-tree schemas are always imported


def test_the_seed_study_preset_is_the_seeds_workload():
    """experiment=seed_study_gpu: Hugging Face's token-classification example of late 2020
    (run_pl.sh, lightning_base.py) as the seed study ran it, under its two strategies."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from sharded_exp.compose import CONF_DIR
    from sharded_exp.optim import optimizer_spec
    from sharded_exp.predict.prediction import meta_model

    cfg = compose(["experiment=seed_study_gpu"])
    m, o, t = cfg.model, cfg.optimizer, cfg.trainer
    assert (m.name, m.vocab_size, m.seq_len, m.num_labels, m.attn_implementation) == (
        "hf_bert_base_multilingual", 119547, 128, 25, "eager")  # fmt: skip
    shapes = {k: m.config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                       "max_position_embeddings", "type_vocab_size")}  # fmt: skip
    assert shapes == dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                          max_position_embeddings=512, type_vocab_size=2)  # fmt: skip
    assert (o.name, o.lr, o.eps, o.weight_decay, o.foreach) == ("adamw", 5e-5, 1e-8, 0.0, False)
    assert str(cfg.precision.name) == "32"
    assert (t.batch_size, t.grad_clip, t.zero_grad.value, t.accelerator.value) == (32, 1.0, "zeros", "gpu")
    sweep = OmegaConf.load(Path(CONF_DIR) / "experiment" / "seed_study_gpu.yaml").hydra.sweeper.params
    assert (sweep.strategy, sweep["trainer.world_size"]) == ("ddp,sharded_ddp", "4,8")
    module = meta_model(m)
    assert 177e6 < sum(p.numel() for p in module.parameters()) < 178e6  # bert-base-multilingual-cased's
    # lightning_base.py's no-decay group (names with "bias" or "LayerNorm.weight") is ours (every 1-D parameter)
    groups = optimizer_spec(o, module).param_groups
    names = {id(p): n for n, p in module.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert no_decay == {n for n in names.values() if "bias" in n or "LayerNorm.weight" in n}
    assert groups[1]["weight_decay"] == groups[0]["weight_decay"] == 0.0


# ----------------------------- values refused with an error line before any rank starts
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.hidden=-5"], "model.hidden=-5 must be >= 1"),
        (["model=gpt", "model.n_heads=0"], "model.n_heads=0 must be >= 1"),
        (["model.num_classes=0"], "model.num_classes=0 must be >= 1"),
        (["model=gpt", "model.seq_len=0"], "model.seq_len=0 must be >= 1"),
        (["optimizer.betas=[2,3]"], "optimizer.betas=[2.0, 3.0] must be two numbers in [0, 1)"),
        (["trainer.timeout_s=inf"], "trainer.timeout_s=inf must be a finite number"),
        (["optimizer.lr=nan"], "optimizer.lr=nan must be a finite number"),
        (["precision=16", "precision.init_scale=0"], "precision.init_scale=0.0 must be > 0"),
    ],
)
def test_bad_model_and_optimizer_values_are_refused_before_spawn(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        launch_job(overrides, tmp_path / "out")
    assert message in str(err.value)


def test_a_bad_model_value_exits_2_without_a_traceback(tmp_path):
    proc = run_cli([*tiny(["model=gpt", "model.n_heads=0"]), f"hydra.run.dir={tmp_path / 'x'}"], cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()  # no empty directory left behind


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["model=custom", "model._target_=tests.helpers.user_models.build_none"],
                     "model._target_=tests.helpers.user_models.build_none returned None (does it return the model?), "
                     "not a torch.nn.Module", marks=pytest.mark.slow),
        pytest.param(["model=custom", "model._target_=tests.helpers.user_models.build_not_a_module"],
                     "returned a dict, not a torch.nn.Module", marks=pytest.mark.slow),
        pytest.param(["model=custom"], "model._target_ must be set: no value was given (model=custom needs model._target_=",
                     marks=pytest.mark.slow),
        (["trainer.checkpoint_dir=${oc.env:SHARDED_EXP_SURELY_UNSET}"],
         "error: trainer.checkpoint_dir: KeyError raised while resolving interpolation: \"Environment variable "
         "'SHARDED_EXP_SURELY_UNSET' not found\""),
    ],
    ids=["factory-returns-none", "factory-returns-a-dict", "custom-without-target", "unset-env-interpolation"],
)  # fmt: skip
def test_bad_models_and_values_get_an_error_line(overrides, message, tmp_path):
    proc = cli(tiny(overrides), tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.mark.slow  # unit: tests/unit/launch/test_preflight.py
def test_find_unused_parameters_is_a_setting_and_unknown_strategy_keys_are_refused(tmp_path):
    unused = ["model=custom", "model._target_=tests.helpers.user_models.build_with_unused", "trainer.steps=3"]
    failed = launch_job(unused, tmp_path / "without")
    assert failed["status"] == "failed" and "find_unused_parameters" in failed["error"]
    result = launch_job([*unused, "strategy.find_unused_parameters=true"], tmp_path / "with")
    assert result["status"] == "ok", result["error"]
    assert result["config"]["strategy"]["find_unused_parameters"] is True
    assert result["memory"]["predicted_peak_mib_max"] is not None, result["memory"]["peak_prediction"]
    with pytest.raises(ConfigError, match=r"strategy.find_unused is not a setting of strategy=zero1, and nothing "
                                          r"would read it; did you mean strategy.find_unused_parameters\? \(its "
                                          r"settings: .*find_unused_parameters"):  # fmt: skip
        launch_job(["strategy=zero1", "+strategy.find_unused=true"], tmp_path / "typo")
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "bad, message",
    [("trainer.eval_every=-1", "trainer.eval_every=-1 must be >= 0 (0 = only at the end)"),
     ("trainer.eval_batches=-2", "trainer.eval_batches=-2 must be >= 0 (0 = no evaluation)")],
)  # fmt: skip
def test_negative_evaluation_settings_are_refused(bad, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch_job([bad], tmp_path / "run")


@pytest.mark.slow
def test_an_unknown_plugin_module_is_refused(tmp_path):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env={"SHARDED_EXP_PLUGINS": "no_such_module"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "SHARDED_EXP_PLUGINS names the module 'no_such_module', which cannot be imported" in proc.stderr


@pytest.mark.slow
def test_schemas_are_not_listed_as_options(tmp_path):
    proc = run_cli(["precision=8", f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode != 0 and "precision=8 is not an option of precision (options:" in proc.stderr
    assert "_schema" not in proc.stderr and "bf16" in proc.stderr


def test_preflight_decides_in_a_job_spec_and_leaves_the_composed_config_as_it_was(tmp_path):
    """Pre-flight never changes the config it reads: its decisions are the JobSpec's, frozen,
    and its config (what the ranks, result.json and .hydra/config.yaml see) holds them."""
    import dataclasses
    import pickle

    from omegaconf import OmegaConf

    cfg = compose(["trainer.checkpoint_every=2", "strategy=fsdp", "trainer.resume=auto"])
    before = OmegaConf.to_yaml(cfg)
    spec = preflight.check(cfg, str(tmp_path), peak=False)
    assert OmegaConf.to_yaml(cfg) == before  # nothing written back
    assert cfg.trainer.checkpoint_dir is None and str(cfg.trainer.checkpoint_format.value) == "auto"
    t = spec.config["trainer"]
    assert t["checkpoint_dir"] == str(tmp_path / "checkpoints") == spec.checkpoint.directory
    assert t["checkpoint_format"] == spec.checkpoint.format == "dcp"  # fsdp shards: auto -> dcp
    assert t["resume"] is None and spec.checkpoint.start_step == 0  # auto, and nothing to resume yet
    assert "checkpoint_format: dcp" in spec.config_yaml and f"world_size: {spec.world_size}" in spec.config_yaml
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.world_size = 3
    assert pickle.loads(pickle.dumps(spec)).config == spec.config  # it travels to spawned ranks
    ranks_cfg = spec.cfg()
    with pytest.raises(Exception, match="read-only"):
        ranks_cfg.trainer.steps = 1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_model_with_nothing_to_train_is_refused_before_spawn(strategy):
    """Everything frozen, or no parameter at all: said in the parent, not by DDP's or the
    optimizer's error in every rank (and not by the DDP fallback's error for an fsdp job)."""
    with pytest.raises(ConfigError, match=r"trainer.freeze=\['\*'\] freezes every parameter of model=mlp"):
        validate(compose(tiny([f"strategy={strategy}", "trainer.freeze=[*]"])))
    empty = [
        f"strategy={strategy}",
        "model=custom",
        "model._target_=tests.helpers.user_models.build_without_parameters",
    ]
    with pytest.raises(ConfigError, match="model=custom has no parameters: there is nothing to train"):
        validate(compose(tiny(empty)))


@pytest.mark.parametrize("precision,param_dtype", [("16", "bfloat16"), ("bf16", "float16")])
def test_an_fsdp_param_dtype_autocast_cannot_compute_with_is_refused(precision, param_dtype):
    """Two half dtypes in one matmul crash every rank; said before spawn, naming what works."""
    cfg = compose(tiny(["strategy=fsdp", f"precision={precision}", f"strategy.param_dtype={param_dtype}"]))
    with pytest.raises(ConfigError, match=rf"strategy.param_dtype={param_dtype} is not precision={precision}'s"):
        validate(cfg)
    for fine in (
        ["precision=32", "strategy.param_dtype=bfloat16"],
        [f"precision={precision}", "strategy.param_dtype=float32"],
    ):
        assert validate(compose(tiny(["strategy=fsdp", *fine]))) > 0


def test_messages_read_as_english(capsys):
    """One sample is a sample; an MLP has no layers to find, and is no raw count (a lever "acts" on
    units: tests/integration/test_levers.py)."""
    from types import SimpleNamespace

    from sharded_exp.data.loader import check_fits
    from sharded_exp.plan import command

    with pytest.raises(ConfigError, match=r"has 1 sample, fewer than one micro-batch"):
        check_fits(SimpleNamespace(dataset=[0]), 2, 2, "custom")
    assert command.main(["model=mlp", "plan.find=depth", "plan.world_sizes=[2]"]) == 2
    assert "model=mlp has none" in capsys.readouterr().err
