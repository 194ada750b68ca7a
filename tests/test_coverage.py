"""Every config field and every group option is exercised by a real run: a coverage test
that grows by itself.

``COVERING`` is a small set of real jobs (training runs, planner runs, one sweep) chosen
so that together they set every field of every schema to a value other than its default
and choose every option of every group. The fields and options are read from the
schemas and the ``conf/`` tree, not listed here: a field or an option added later and
set by no covering run fails :func:`test_every_field_and_option_is_set_by_a_real_run`
by name. Each covering job runs for real below, and is held to more than its exit code:
the loss falls, result.json has its fields, and the setting it covers shows its effect
where that is cheap to see (the loss scale's growth and backoff, the kept checkpoints,
the W&B run's identity, the resumed step).

What cannot run on this machine is named in ``NOT_HERE`` with the reason; nothing else
may be missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from sharded_exp import config
from sharded_exp.compose import CONF_DIR
from sharded_exp.data import TASKS
from sharded_exp.models import MODELS
from sharded_exp.strategies import STRATEGIES
from tests.conftest import ROOT, compose_cfg, run_cli, tiny
from tests.wandb_file import find_runs, read_run

GPT = ["model=gpt", "model.n_layers=1", "model.mlp_ratio=2", "data.seed=3", "data.branching=2"]
WANDB = ["logger=wandb", "logger.mode=offline", "logger.project=coverage", "logger.entity=sharded-exp-tests",
         "logger.group=covering", "logger.job_type=check", "logger.run_name=covering-ddp", "logger.tags=[a,b]",
         "logger.init_timeout_s=30"]  # fmt: skip

ENV = {"ddp": {"SHARDED_EXP_FAULT": "rank=1,step=1,kind=inf_grad"}}
"""The environment of a covering run (a testing aid)."""
RUNS = {
    # DDP's knobs, AdamW's, float16's loss scaling, and the trainer's odds and ends. The inf
    # at step 1 (rank 1's gradient) is skipped and backs the scale off by 0.25; three clean
    # steps double it: 1024 -> 256 -> 512 after 6 steps.
    "ddp": [
        "strategy=ddp", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "strategy.find_unused_parameters=true",
        "strategy.broadcast_buffers=false", "optimizer=adamw", "optimizer.lr=5e-3", "optimizer.weight_decay=0.01",
        "optimizer.no_decay_lr_scale=0.5", "optimizer.betas=[0.8,0.99]", "optimizer.eps=1e-7", "precision=16",
        "precision.init_scale=1024", "precision.growth_interval=3", "precision.backoff_factor=0.25",
        "trainer.seed=1", "trainer.grad_clip=0.5", "trainer.memory_limit_mib=1000", "trainer.stop_grace_s=30",
        "trainer.accelerator=cpu", "trainer.progress_bar=true", "model.in_features=32", "model.num_classes=5",
        "data.seed=7", "data.teacher_hidden=16", *WANDB,
    ],
    # OSS's knobs, SGD with momentum, the GPT's shape, bf16, three ranks.
    "oss": [
        "strategy=oss", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "trainer.activation_checkpointing=selective", "trainer.ac_every=2", "trainer.compile=true",
        "trainer.compile_mode=reduce_overhead", "trainer.timeout_s=300",  # a cold compile may be slow on one rank
        "strategy.broadcast_buffers=false", "strategy.broadcast_fp16=true", "strategy.find_unused_parameters=true",
        "optimizer=sgd", "optimizer.lr=0.05",
        "optimizer.momentum=0.9", *GPT, "precision=bf16", "trainer.world_size=3",
    ],
    # ShardedDDP without reduce buckets, BERT token classification, accumulation, evaluation.
    "sharded_ddp": [
        "strategy=sharded_ddp", "strategy.reduce_buffer_size=0", "strategy.broadcast_buffers=false",
        "strategy.broadcast_fp16=true", "model=hf_bert", "model.seq_len=16", "trainer.batch_size=4",
        "optimizer.lr=3e-3", "data.seed=5", "data.min_len=0.25", "trainer.grad_accum=2", "trainer.eval_every=2",
        "trainer.eval_batches=2", "trainer.log_interval=3", "trainer.steps=8",
    ],
    # ZeRO-1's knobs, GPT-2 (causal LM), consolidated checkpoints of which one is kept.
    "zero1": [
        "strategy=zero1", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "strategy.broadcast_buffers=false", "strategy.parameters_as_bucket_view=true",
        "strategy.find_unused_parameters=true", "model=hf_gpt2",
        "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data.seed=9", "data.branching=2",
        "trainer.checkpoint_every=2", "trainer.checkpoint_format=consolidated", "trainer.keep_checkpoints=1",
        "trainer.save_final_state=true", "trainer.checkpoint_dir=__tmp__zero1_ckpt",
    ],
    # FSDP keeping gathered parameters (ZeRO-2-like), Llama, asynchronous DCP checkpoints,
    # a frozen embedding, a longer warm-up.
    "fsdp": [
        "strategy=fsdp", "strategy.reshard_after_forward=false", "strategy.broadcast_buffers=false", "model=hf_llama", "model.seq_len=16",
        "strategy.replicate=2", "strategy.param_dtype=float32", "strategy.reduce_dtype=bfloat16",
        "trainer.activation_checkpointing=full",
        "trainer.batch_size=4", "optimizer.lr=3e-3", "trainer.checkpoint_every=3", "trainer.checkpoint_format=dcp",
        "trainer.checkpoint_async=true", "trainer.warmup_steps=2", "trainer.freeze=[model.embed_tokens.*]",
        "trainer.timeout_s=90",
    ],
    # FSDP resharding after forward (ZeRO-3) on your own model: 4 steps with checkpoints ...
    "fsdp_grad_op": [
        "strategy=fsdp_grad_op", "strategy.reshard_after_forward=true", "strategy.broadcast_buffers=false",
        "strategy.replicate=2", "strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32",
        "model=custom", "model._target_=tests.user_models.build", "+model.hidden=24", "optimizer.lr=1e-2", "trainer.steps=4",
        "trainer.checkpoint_every=2", "trainer.checkpoint_dir=__tmp__grad_op_ckpt", "trainer.host_memory_check=false",
    ],
    # ... then resumed (resume=auto) to step 8 from the newest of them.
    "fsdp_grad_op_resumed": [
        "strategy=fsdp_grad_op", "strategy.reshard_after_forward=true", "model=custom",
        "model._target_=tests.user_models.build", "+model.hidden=24", "optimizer.lr=1e-2", "trainer.steps=8",
        "trainer.checkpoint_every=2", "trainer.checkpoint_dir=__tmp__grad_op_ckpt", "trainer.resume=auto",
        "trainer.existing_checkpoints=archive",
    ],
}  # fmt: skip
"""Training runs (``tiny`` adds the small shapes): one per strategy, each setting its knobs."""
AFTER = {"fsdp_grad_op_resumed": "fsdp_grad_op"}

PLANS = {
    # Every shape preset, planned (too large to train here: the fake step is their real run)
    # at its full width and two layers (depth only repeats them), with every planner setting.
    "gpt_presets": ["model=gpt2_small", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]",
                    "plan.format=json", "plan.device_memory_gib=40"],
    "gpt2_medium": ["model=gpt2_medium", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]",
                    "plan.by_depth=false"],
    "gpt2_large": ["model=gpt2_large", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]"],
    "gpt2_xl": ["model=gpt2_xl", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]"],
    "gpt_7b": ["model=gpt_7b", "model.n_layers=2", "plan.world_sizes=[64]", "plan.strategies=[fsdp]",
               "trainer.batch_size=1"],
    "hf_bert_base": ["model=hf_bert_base", "model.config.num_hidden_layers=2", "plan.world_sizes=[4]",
                     "plan.strategies=[ddp]"],
    "hf_gpt2_small": ["model=hf_gpt2_small", "model.config.n_layer=2", "plan.world_sizes=[4]",
                      "plan.strategies=[fsdp]"],
    "hf_gpt2_xl": ["model=hf_gpt2_xl", "model.config.n_layer=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]"],
    "hf_llama_7b": ["model=hf_llama_7b", "model.config.num_hidden_layers=2", "plan.world_sizes=[64]",
                    "plan.strategies=[fsdp]", "trainer.batch_size=1"],
    "raw_count": ["plan.params=7.5e9", "plan.units=16", "plan.world_sizes=[64]", "plan.plot=raw_count.png"],
    "find_depth": ["model=gpt", "plan.find=depth", "plan.device=cpu", "plan.levers=[none,ac_selective]", "plan.world_sizes=[2]", "plan.strategies=[ddp]",
                   "plan.device_memory_gib=0.05"],
}  # fmt: skip
"""Planner runs (``python -m sharded_exp.plan``), in this process."""

SWEEP_SHRINK = ["trainer.steps=3", "trainer.warmup_steps=1", "trainer.eval_batches=1", "logger=none",
                "trainer.world_size=2"]  # fmt: skip
SWEEPS = {
    # The presets are sweeps: each is run as a user types it, shrunk to two points / one point.
    "seed_table": ["experiment=seed_table", "model.d_model=32", "model.n_layers=1", "model.seq_len=16",
                   "strategy=ddp,oss", *SWEEP_SHRINK],
    "seed_study": ["experiment=seed_study", "model.seq_len=16", "trainer.batch_size=2",
                   "strategy=zero1", *SWEEP_SHRINK],
}  # fmt: skip
"""Multirun sweeps (``python -m sharded_exp -m``, a real subprocess) ending in their report;
a command-line sweep of a key replaces the preset's own values for it, as in Hydra."""

NOT_HERE = {
    ("experiment", "seed_study_gpu"): "needs GPUs (trainer.accelerator=gpu): benchmarks/gpu_check.py's machine",
}
"""Options no run on this CPU-only machine can choose, and why."""
FIELDS_NOT_HERE = {
    ("strategy:fsdp", "cpu_offload"): "GPU runs only (a CPU run refuses it: tests/test_levers.py); planned by "
    "plan.levers=[offload] (test_levers); run by benchmarks/device_check.py's offload check",
    ("strategy:fsdp_grad_op", "cpu_offload"): "as for fsdp",
}
"""Fields no run on this CPU-only machine can set, and why."""


# ------------------------------------------------------------------- the covering jobs
@pytest.fixture(scope="module")
def placeholders(tmp_path_factory):
    cache: dict[str, str] = {}

    def resolve(overrides: list[str]) -> list[str]:
        out = []
        for o in overrides:
            if "=__tmp__" in o:  # a directory of this test session
                key, name = o.split("=__tmp__")
                cache.setdefault(name, str(tmp_path_factory.mktemp(name)))
                o = f"{key}={cache[name]}"
            out.append(o)
        return out

    return resolve


def _run(name: str, shared_runs, placeholders) -> tuple[Path, dict]:
    if name in AFTER:
        _run(AFTER[name], shared_runs, placeholders)
    return shared_runs(*placeholders(RUNS[name]), env=ENV.get(name))


@pytest.mark.parametrize("name", list(RUNS))
def test_covering_run(name, shared_runs, placeholders):
    out, result = _run(name, shared_runs, placeholders)
    assert result["status"] == "ok", result.get("error")
    losses = [h["loss"] for h in result["history"]]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    for key in ("params", "param_digest", "throughput", "memory", "timeline", "config"):
        assert result[key], key
    mem = result["memory"]
    assert mem["peak_error"] is None and mem["peak_prediction"]["error"] is None
    assert abs(mem["peak_rel_error_max"]) <= 0.10
    assert mem["model_states_rel_error_max"] <= 0.02
    cfg = result["config"]
    for o in placeholders(RUNS[name]):  # every override reached the job's resolved config
        key, value = o.lstrip("+").split("=", 1)
        if "." in key and not value.startswith("[") and key != "trainer.resume":  # resume=auto: resolved
            section, *rest = key.split(".")
            node = cfg[section]
            for part in rest:
                node = node[part]
            assert str(node).lower() == value.lower() or float(node) == pytest.approx(float(value)), (o, node)
    CHECKS.get(name, lambda out, result: None)(out, result)


def _check_ddp(out, result):
    for r in result["memory"]["per_rank"]:
        assert r["skipped_steps"] == 1 and r["loss_scale"] == 512.0, r
    (run_file,) = find_runs(out)
    run = read_run(run_file)
    assert (run["group"], run["job_type"], run["name"]) == ("covering", "check", "covering-ddp")
    assert {"a", "b"} <= set(run["tags"]) and run["exit_code"] == 0
    assert run["summary"]["final_loss"] == result["final_loss"]


def _check_sharded_ddp(out, result):
    assert [e["step"] for e in result["eval"]["history"]] == [2, 4, 6, 8]
    assert 0 <= result["eval"]["final"]["eval/accuracy"] <= 1


def _check_zero1(out, result):
    kept = sorted(p.name for p in Path(result["config"]["trainer"]["checkpoint_dir"]).iterdir() if p.is_dir())
    assert kept == ["step_00000006"], kept
    assert (out / "model_final.pt").exists()


def _check_fsdp(out, result):
    assert result["checkpoint"].endswith("step_00000006")
    states = result["memory"]["per_rank"][0]["model_states_mib"]
    assert states["grads"] < states["params"]  # the frozen embedding has no gradient


def _check_resumed(out, result):
    assert result["start_step"] == 4 and result["steps_done"] == 8
    assert result["resumed_from"].endswith("step_00000004")


CHECKS = {
    "ddp": _check_ddp,
    "sharded_ddp": _check_sharded_ddp,
    "zero1": _check_zero1,
    "fsdp": _check_fsdp,
    "fsdp_grad_op_resumed": _check_resumed,
}


@pytest.mark.parametrize("name", list(PLANS))
def test_covering_plan(name, capsys, tmp_path, monkeypatch):
    from sharded_exp import plan

    monkeypatch.chdir(tmp_path)  # where plan.plot draws
    assert plan.main(["plan.format=json", *PLANS[name]]) == 0
    for o in PLANS[name]:
        if o.startswith("plan.plot="):
            assert (tmp_path / o.split("=", 1)[1]).stat().st_size > 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] and all(r["total_gib"] > 0 for r in out["rows"])
    if "plan.find=depth" in PLANS[name]:
        plain, selective = out["found"]  # one per lever combination
        assert plain["levers"] == "none" and selective["levers"] == "ac_selective"
        assert 1 <= plain["value"] <= selective["value"], out["found"]  # recomputing fits at least as deep


@pytest.mark.parametrize("name", list(SWEEPS))
def test_covering_sweep(name, tmp_path):
    proc = run_cli(["-m", *SWEEPS[name], f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = sorted(tmp_path.glob("*/result.json"))
    assert points and all(json.loads(p.read_text())["status"] == "ok" for p in points)
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.csv").exists()


# ------------------------------------------------------------------------ the coverage
def _options() -> dict[str, list[str]]:
    groups = ("strategy", "precision", "model", "optimizer", "data", "trainer", "logger", "experiment")
    return {g: sorted(p.stem for p in (Path(CONF_DIR) / g).glob("*.yaml")) for g in groups}


def _schemas() -> dict[str, type]:
    """Every schema by the config path its fields live under (``strategy:oss``: the oss
    option's schema under ``strategy``)."""
    out = {
        "precision": config.PrecisionConfig,
        "optimizer": config.OptimizerConfig,
        "trainer": config.TrainerConfig,
        "logger": config.LoggerConfig,
        "plan": config.PlanSettings,
    }
    for group, registry in (("strategy", STRATEGIES), ("model", MODELS), ("data", TASKS)):
        for name in registry.names():
            out[f"{group}:{name}"] = registry.config_class(name)
    return out


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _plain(value):
    from omegaconf import OmegaConf

    if hasattr(value, "_metadata"):
        value = OmegaConf.to_container(value)
    return getattr(value, "value", value)


def _covering_configs() -> list[tuple[str, object, list[str]]]:
    """(job, composed config, overrides) of every covering job."""
    out = []
    for name, overrides in RUNS.items():
        out.append((f"run {name}", compose_cfg(tiny(overrides)), overrides))
    for name, overrides in PLANS.items():
        out.append((f"plan {name}", compose_cfg(overrides, "plan"), overrides))
    for name, overrides in SWEEPS.items():
        # one point per value of each swept key
        points = [[]]
        for o in overrides:
            key, value = o.split("=", 1)
            points = [[*p, f"{key}={v}"] for p in points for v in value.split(",")]
        out += [(f"sweep {name}", compose_cfg(p), overrides) for p in points]
    return out


def test_every_field_and_option_is_set_by_a_real_run():
    configs = _covering_configs()
    missing = []
    # Every option of every group is chosen by some covering job.
    for group, options in _options().items():
        for option in options:
            if (group, option) in NOT_HERE:
                continue
            chosen = any(
                f"{group}={option}" in overrides
                or (group == "trainer" and option == "default")  # the group's only option
                or (group == "data" and cfg.data.name == option)  # chosen by the model's defaults
                or (not any(o.startswith(f"{group}=") for o in overrides) and _is_default(group, option))
                for _, cfg, overrides in configs
            )
            if not chosen:
                missing.append(f"option {group}={option}")
    # Every field of every schema is set to a value other than its default by some job
    # that uses that schema.
    for where, schema in _schemas().items():
        group, _, option = where.partition(":")
        for f in dataclasses.fields(schema):
            if f.name == "name" or (where, f.name) in FIELDS_NOT_HERE:  # the option itself, covered above
                continue
            covered_by = [
                job
                for job, cfg, _ in configs
                if group in cfg
                and (not option or cfg[group].get("name") == option)
                and f.name in cfg[group]
                and _plain(cfg[group][f.name]) != _plain(_default(f))
            ]
            if not covered_by:
                missing.append(f"field {group}.{f.name}" + (f" (of {group}={option})" if option else ""))
    assert not missing, "set by no covering run in tests/test_coverage.py:\n  " + "\n  ".join(missing)


def _is_default(group: str, option: str) -> bool:
    from omegaconf import OmegaConf

    root = OmegaConf.load(Path(CONF_DIR) / "config.yaml")
    for entry in root.defaults:
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            if group in entry:
                return str(entry[group]) == option
    return False


def test_fields_not_here_name_real_fields():
    schemas = _schemas()
    for where, name in FIELDS_NOT_HERE:
        assert name in [f.name for f in dataclasses.fields(schemas[where])], (where, name)


def test_not_here_names_real_options():
    options = _options()
    for group, option in NOT_HERE:
        assert option in options[group], (group, option)
