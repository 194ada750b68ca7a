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

The training runs (``RUNS``) live in tests/helpers/covering.py, where other test modules
share them; the planner runs and sweeps are here. What cannot run on this machine is
named in ``NOT_HERE`` with the reason; nothing else may be missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from sharded_exp.compose import CONF_DIR, compose
from sharded_exp.reference import own_fields
from tests.helpers.covering import ENV, RUNS
from tests.helpers.jobs import ROOT, run_cli, tiny, write_tiny_config
from tests.helpers.runs import check_starts_from_saved
from tests.helpers.wandb_file import find_runs, read_run

SLOW_RUNS = {"text_file", "hf_dataset_ner", "hf_dataset_json", "custom_classes", "custom_lm", "oss_compiled"}
"""Covering runs in the slow tier (the default tier's budget): the data options beyond conll, and
the compiled run."""
AFTER = {"fsdp_grad_op_resumed": "fsdp_grad_op"}

PLANS = {
    # Every shape preset, planned (too large to train here: the fake step is their real run)
    # at its full width and two layers (depth only repeats them), with every planner setting.
    "gpt_presets": ["model=gpt2_small", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]",
                    "plan.format=json", "plan.device_memory_gib=40"],
    "gpt2_medium": ["model=gpt2_medium", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]",
                    "plan.by_depth=false"],
    "gpt2_large": ["model=gpt2_large", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[ddp,fsdp]",
                   "plan.workers=2"],  # two strategies faked side by side
    "gpt2_xl": ["model=gpt2_xl", "model.n_layers=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]"],
    "gpt_7b": ["model=gpt_7b", "model.n_layers=2", "plan.world_sizes=[64]", "plan.strategies=[fsdp]",
               "plan.alloc_conf=expandable_segments:True",
               "trainer.batch_size=1", "plan.device_profile=a100_80gb", "plan.gpus_per_node=4",
               "plan.inter_node_gbps=200", "plan.levers=[none,offload]", "plan.host_memory_gib=0.5"],
    "hf_bert_base": ["model=hf_bert_base", "model.config.num_hidden_layers=2", "plan.world_sizes=[4]",
                     "plan.strategies=[ddp]"],
    # The seed study's model (experiment=seed_study_gpu needs GPUs) under its sharded strategy.
    "hf_bert_base_multilingual": ["model=hf_bert_base_multilingual", "model.config.num_hidden_layers=2",
                                  "model.num_labels=25", "plan.world_sizes=[4]", "plan.strategies=[sharded_ddp]"],
    "hf_gpt2_small": ["model=hf_gpt2_small", "model.config.n_layer=2", "plan.world_sizes=[4]",
                      "plan.strategies=[fsdp]"],
    "hf_gpt2_xl": ["model=hf_gpt2_xl", "model.config.n_layer=2", "plan.world_sizes=[8]", "plan.strategies=[fsdp]"],
    "hf_llama_7b": ["model=hf_llama_7b", "model.config.num_hidden_layers=2", "plan.world_sizes=[64]",
                    "plan.strategies=[fsdp]", "trainer.batch_size=1"],
    # A published model's config.json alone (AutoModelForCausalLM, random weights), at its own sizes.
    "hf_causal": ["model=hf_causal", "model.config_file=__config__gpt_neox", "plan.world_sizes=[2]",
                  "plan.strategies=[fsdp]", "trainer.batch_size=2"],
    "raw_count": ["plan.params=7.5e9", "plan.units=16", "plan.world_sizes=[64]", "plan.plot=raw_count.png"],
    # Every column in the terminal's table, under the full headings (json, md and csv always hold them).
    "table_all": ["model=gpt", "model.n_layers=1", "plan.device=cpu", "plan.world_sizes=[2]", "plan.strategies=[ddp]",
                  "plan.format=table", "plan.columns=all"],
    "find_depth": ["model=gpt", "plan.find=depth", "plan.device=cpu", "plan.levers=[none,ac_selective]", "plan.world_sizes=[2]", "plan.strategies=[ddp]",
                   "plan.device_memory_gib=0.05"],
    "find_fastest": ["model=gpt", "model.n_layers=2", "model.d_model=64", "model.seq_len=32", "plan.find=fastest",
                     "plan.device=cpu", "plan.remeasure=true", "plan.world_sizes=[2]", "plan.strategies=[ddp,fsdp]",
                     "trainer.batch_size=2", "plan.workers=2"],  # the candidates planned side by side
}  # fmt: skip
"""Planner runs (``python -m sharded_exp.plan``), in this process. ``__config__KIND``: a tiny
config.json of tests/helpers/jobs.py's ``TINY_CONFIGS``, written by the test."""

SWEEP_SHRINK = ["trainer.steps=3", "trainer.warmup_steps=1", "trainer.eval_batches=1", "logger=none",
                "trainer.world_size=2"]  # fmt: skip
SWEEPS = {
    # The presets are sweeps: each is run as a user types it, shrunk to two points / one point.
    # its headline prices the speed ratio on the seed study's GPU (report.device_profile)
    "seed_table": ["experiment=seed_table", "model.d_model=32", "model.n_layers=1", "model.seq_len=16",
                   "strategy=ddp,oss", "report.device_profile=v100_32gb", *SWEEP_SHRINK],
    "seed_study": ["experiment=seed_study", "model.seq_len=16", "trainer.batch_size=2",
                   "strategy=zero1", "data.seed=5", "data.min_len=0.25", *SWEEP_SHRINK],
    # BERT-base's width at one layer, on a CoNLL file made by the test.
    "seed_study_conll": ["experiment=seed_study_conll", "model.seq_len=16", "trainer.batch_size=2",
                         "model.config.num_hidden_layers=1", "data.path=__data__train.conll",
                         "data.tokenizer=__data__tok", "strategy=oss", *SWEEP_SHRINK],
    # Optuna's preset, two trials of the smoke preset (the root's debug, hparams_search, objective).
    # precision in its number form, as users write it (Optuna formats its pick back into precision=32).
    "hparams_search": ["hparams_search=fastest", "debug=fast", "hydra.sweeper.n_trials=2", "precision=choice(32,bf16)"],
}  # fmt: skip
# paths.output_dir places each sweep (a preset's own hydra.sweep.dir is made from it)
SWEEPS = {name: [*o, f"paths.output_dir=__tmp__sweep_{name}"] for name, o in SWEEPS.items()}
SLOW_SWEEPS = {
    "seed_study_conll",
    "hparams_search",
    "seed_study",
    "seed_table",
}  # the experiment presets: real sweeps, slow tier
"""Multirun sweeps (``python -m sharded_exp -m``, a real subprocess) ending in their report;
a command-line sweep of a key replaces the preset's own values for it, as in Hydra."""

NOT_HERE = {
    (
        "experiment",
        "seed_study_gpu",
    ): "needs GPUs (trainer.accelerator=gpu): benchmarks/accuracy/gpu_check.py's machine",
}
"""Options no run on this CPU-only machine can choose, and why."""
FIELDS_NOT_HERE = {
    (
        "strategy:fsdp",
        "cpu_offload",
    ): "GPU runs only (a CPU run refuses it: tests/integration/test_levers.py); planned by "
    "plan.levers=[offload] (test_levers); run by benchmarks/accuracy/device_check.py's offload check",
    ("strategy:fsdp_grad_op", "cpu_offload"): "as for fsdp",
}
"""Fields no run on this CPU-only machine can set, and why."""


# ------------------------------------------------------------------- the covering jobs
def _run(name: str, shared_runs, placeholders) -> tuple[Path, dict]:
    if name in AFTER:
        _run(AFTER[name], shared_runs, placeholders)
    return shared_runs(*placeholders(RUNS[name]), env=ENV.get(name))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n for n in RUNS])
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
        # resume=auto and ${...} interpolations are resolved in the job's config
        if "." in key and not value.startswith("[") and key != "trainer.resume" and "${" not in value:
            section, *rest = key.split(".")
            node = cfg[section]
            for part in rest:
                node = node[part]
            assert str(node).lower() == value.lower() or float(node) == pytest.approx(float(value)), (o, node)
    CHECKS.get(name, lambda out, result: None)(out, result)


def _check_ddp(out, result):
    assert result["zero_grad"] == {"requested": "zeros", "applied": "zeros", "reason": None}
    for r in result["memory"]["per_rank"]:
        assert r["skipped_steps"] == 1 and r["loss_scale"] == 512.0, r
    (run_file,) = find_runs(out)
    run = read_run(run_file)
    assert (run["group"], run["job_type"], run["name"]) == ("covering", "check", "covering-ddp")
    assert {"a", "b"} <= set(run["tags"]) and run["exit_code"] == 0
    assert run["summary"]["final_loss"] == result["final_loss"]
    # trainer.profile: a trace per rank of the 2 steps after the CPU tracker's window (steps
    # 0 and 1), which are not timed: steps 4 and 5 are.
    profile = result["profile"]
    assert profile["steps"] == [2, 3] and profile["error"] is None and result["throughput"]["timed_steps"] == 2
    assert profile["files"] == [str(out / "trace_rank0.json"), str(out / "trace_rank1.json")]
    for path in profile["files"]:
        events = json.loads(Path(path).read_text())["traceEvents"]
        assert {"step 2", "step 3"} <= {e.get("name") for e in events}
    assert profile["size_mib_per_rank"] * 2**20 == max(Path(p).stat().st_size for p in profile["files"])
    assert profile["cost_ratio"] == pytest.approx(
        profile["step_time_s_median"] / profile["unprofiled_step_time_s_median"]
    )
    # trainer.memory_snapshot=always on CPU: no CUDA allocator, nothing recorded, said why.
    snapshot = result["memory"]["memory_snapshot"]
    assert snapshot["setting"] == "always" and not snapshot["recorded"] and snapshot["files"] == []
    assert "on CPU" in snapshot["reason"]


def _check_sharded_ddp(out, result):
    # trainer.zero_grad=free (the default) is not honoured by ShardedDDP: said, in result.json
    # and in the prediction, which fakes what runs
    assert result["zero_grad"]["requested"] == "free" and result["zero_grad"]["applied"] == "zeros"
    assert "ShardedDataParallel computes wrong gradients" in result["zero_grad"]["reason"]
    assert "trainer.zero_grad=free not honoured, faked as zeros" in result["memory"]["peak_prediction"]["note"]
    assert [e["step"] for e in result["eval"]["history"]] == [2, 4, 6, 8]
    assert 0 <= result["eval"]["final"]["eval/accuracy"] <= 1
    # The DataLoader's wait is measured apart from the step (a worker per rank made the batches).
    throughput = result["throughput"]
    assert throughput["data_prefetched"] is True and 0 < throughput["data_time_s_per_step"]


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
    "pretrained": lambda out, result: check_starts_from_saved(result),
}


SLOW_PLANS = {
    "find_fastest",  # a search over strategies x levers x batches, each point traced
    # the model presets: their families' fake steps plan in the default tier (test_plan.py, test_ac_plan.py,
    # gpt_7b and gpt2_large here), and every option and field they set is counted below from both tiers
    "gpt_presets", "gpt2_medium", "gpt2_xl", "hf_bert_base", "hf_bert_base_multilingual", "hf_gpt2_small",
    "hf_gpt2_xl", "hf_llama_7b",
}  # fmt: skip
"""Planner runs in the slow tier (the default tier's budget)."""


def _tiny_config(override: str, directory: Path) -> str:
    """``key=__config__KIND`` with KIND's tiny config.json written into ``directory``."""
    key, _, kind = override.partition("=__config__")
    return f"{key}={write_tiny_config(directory, kind)}" if kind else override


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PLANS else n for n in PLANS])
def test_covering_plan(name, capsys, tmp_path, monkeypatch):
    from sharded_exp.plan import command

    monkeypatch.chdir(tmp_path)  # where plan.plot draws
    overrides = [_tiny_config(o, tmp_path) for o in PLANS[name]]
    assert command.main(["plan.format=json", *overrides]) == 0
    if "plan.format=table" in overrides:  # a person's table: every column, under its full heading
        out = capsys.readouterr().out.splitlines()
        head = next(line for line in out if line.startswith("strategy"))
        assert all(c in head for c in ("levers", "allocated", "step_time_s", "tokens_per_s_per_device")), head
        return
    for o in PLANS[name]:
        if o.startswith("plan.plot="):
            assert (tmp_path / o.split("=", 1)[1]).stat().st_size > 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] and all(r["total_gib"] > 0 for r in out["rows"])
    assert all(0 < r["mean_gib"] <= r["total_gib"] * (1 + 1e-12) for r in out["rows"])  # the average over ranks
    if not any(o.startswith("plan.params=") for o in PLANS[name]):  # a model: every point timed
        assert all(r["step_time_s"] > 0 and r["mfu_pct"] > 0 for r in out["rows"]), out["rows"]
    if any(o.startswith("plan.host_memory_gib=") for o in PLANS[name]):  # a node's host too small to offload to
        offloaded = [r for r in out["rows"] if r["levers"] == "offload"]
        assert offloaded and all(r["host_node_gib"] > 0.5 and not r["fits"] for r in offloaded), offloaded
        assert all("more than its 0.5 GiB (plan.host_memory_gib)" in r["note"] for r in offloaded)
        assert all(r["fits"] for r in out["rows"] if r["levers"] == "none")  # the device alone: fits
    if "plan.find=fastest" in PLANS[name]:
        (best,) = out["found"]
        assert best["strategy"] in ("ddp", "fsdp") and best["command"].startswith("sharded-exp model=gpt ")
        assert best["batch_size"] * best["grad_accum"] == 2  # the global batch is kept
    if "plan.find=depth" in PLANS[name]:
        plain, selective = out["found"]  # one per lever combination
        assert plain["levers"] == "none" and selective["levers"] == "ac_selective"
        assert 1 <= plain["value"] <= selective["value"], out["found"]  # recomputing fits at least as deep


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SWEEPS else n for n in SWEEPS])
def test_covering_sweep(name, placeholders):
    overrides = placeholders(SWEEPS[name])
    proc = run_cli(["-m", *overrides], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = Path(overrides[-1].partition("=")[2])  # paths.output_dir
    (sweep,) = [p.parent for p in root.glob("*/*/report.md")]
    assert sweep.parent.name == ("multirun" if name == "hparams_search" else name), sweep
    points = sorted(sweep.glob("*/result.json"))
    assert points and all(json.loads(p.read_text())["status"] == "ok" for p in points)
    assert (sweep / "report.csv").exists()
    if name == "seed_table":  # report.device_profile: the planned ratio beside the measured one
        assert (
            "Planned: each point's config priced by the planner's time model on v100_32gb"
            in (sweep / "report.md").read_text()
        )
    if name == "hparams_search":  # Optuna's best trial is the fastest point, by result.json
        import yaml

        best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_value"]
        results = [json.loads(p.read_text()) for p in points]
        assert len(points) == 2 and all(r["config"]["trainer"]["steps"] == 2 for r in results)  # debug=fast
        assert {r["config"]["precision"]["name"] for r in results} <= {"32", "bf16"}  # precision=choice(32,bf16)
        assert best == max(r["throughput"]["samples_per_s"] for r in results)


# ------------------------------------------------------------------------ the coverage
def _options() -> dict[str, list[str]]:
    groups = ("strategy", "precision", "model", "optimizer", "data", "trainer", "logger", "paths", "experiment",
              "hparams_search", "debug")  # fmt: skip
    return {g: sorted(p.stem for p in (Path(CONF_DIR) / g).glob("*.yaml")) for g in groups}


def _schemas() -> dict[str, type]:
    """Every schema by the config path its fields live under (``strategy:oss``: the oss
    option's schema under ``strategy``): the generated config reference's own list."""
    from sharded_exp.reference import config_schemas

    return config_schemas()


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
        out.append((f"run {name}", compose(tiny(overrides)), overrides))
    for name, overrides in PLANS.items():
        out.append((f"plan {name}", compose(overrides, "plan"), overrides))
    for name, overrides in SWEEPS.items():
        # one point per value of each swept key
        points = [[]]
        for o in overrides:
            key, value = o.split("=", 1)
            value = re.sub(r"^(?:choice|sort|shuffle)\((.*)\)$", r"\1", value)  # a sweep function's values
            points = [[*p, f"{key}={v}"] for p in points for v in value.split(",")]
        out += [(f"sweep {name}", compose(p), overrides) for p in points]
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
            # an alias (precision=fp16 is precision=16 by another name) is chosen with its option
            chosen = chosen or any(
                f"{group}={other}" in overrides
                for other in _aliases(group, options).get(option, [])
                for _, _, overrides in configs
            )
            if not chosen:
                missing.append(f"option {group}={option}")
    # Every field of every schema is set to a value other than its default by some job
    # that uses that schema.
    for where, schema in _schemas().items():
        group, _, option = where.partition(":")
        for f in own_fields(schema):
            if f.name == "name" or (where, f.name) in FIELDS_NOT_HERE:  # the option itself, covered above
                continue
            covered_by = [
                job
                for job, cfg, _ in configs
                if (not group or group in cfg)
                and (not option or cfg[group].get("name") == option)
                and f.name in (cfg[group] if group else cfg)
                and _plain((cfg[group] if group else cfg)[f.name]) != _plain(_default(f))
            ]
            if not covered_by:
                missing.append(
                    f"field {group + '.' if group else ''}{f.name}" + (f" (of {group}={option})" if option else "")
                )
    # The Hugging Face and custom models have no schema (their YAML is the model's config):
    # each of their settings that is off by default (null, e.g. model.pretrained) is turned
    # on by some covering job with that kind of model.
    for option in _options()["model"]:
        node = compose([f"model={option}"]).model
        if "_target_" not in node:
            continue
        for key in [k for k in node if k not in ("name", "_target_", "config") and node[k] is None]:
            if not any("_target_" in cfg.model and cfg.model.get(key) is not None for _, cfg, _ in configs):
                missing.append(f"field model.{key} (of model={option})")
    assert not missing, (
        "set by no covering run in tests/helpers/covering.py or tests/integration/test_coverage.py:\n  "
        + "\n  ".join(missing)
    )


def _aliases(group: str, options: list[str]) -> dict[str, list[str]]:
    """Options that are one another by another name (precision=fp16 is precision=16:
    :func:`sharded_exp.precision.alias_options`), both ways. They compose to the same config
    (tests/integration/test_sweep.py::test_precision_aliases_compose_as_their_option)."""
    from sharded_exp.precision import alias_options

    out: dict[str, list[str]] = {}
    for alias, option in alias_options().items() if group == "precision" else ():
        if option in options:
            out.setdefault(option, []).append(alias)
            out.setdefault(alias, []).append(option)
    return out


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


def test_the_config_reference_is_generated_and_names_every_field():
    """docs/reference/config.md is what ``python -m sharded_exp.reference`` writes (it cannot
    drift from the schemas), and it names every field of every schema this test covers."""
    from sharded_exp.reference import markdown

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert page == markdown(), "docs/reference/config.md is stale: python -m sharded_exp.reference > it"
    for where, schema in _schemas().items():
        group = where.partition(":")[0]
        for f in own_fields(schema):
            assert f"| `{group + '.' if group else ''}{f.name}` |" in page, (where, f.name)
