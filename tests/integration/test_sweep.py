"""Hydra's own sweepers and launchers, and W&B Sweeps: the objective ``main`` returns, the
precision options under every sweep syntax, the launchers that can (and cannot) host the
ranks, and examples/sweep.yaml composed option by option."""

from __future__ import annotations

import json
import math
import os
import pickle

import pytest
import yaml
from omegaconf import OmegaConf

from sharded_exp.compose import CONF_DIR, compose, quote_numeric_choices
from sharded_exp.errors import ConfigError
from sharded_exp.sweep import (
    OBJECTIVES,
    check_multirun,
    check_objective,
    objective_value,
    result_at,
    sweeper_direction,
)
from tests.helpers.jobs import ROOT, TINY, run_cli

SHRINK = [o for o in TINY if not o.startswith("model.")] + ["trainer.steps=3"]


# ------------------------------------------------------------------------- the objective
def test_every_objective_is_a_number_of_a_real_result(shared_runs):
    # The tiny GPT (a token model: tokens/s, and its evaluation at the end) has every objective;
    # the covering runs' BERT on its CoNLL file and tokenizer cost twice as much or more where
    # test_coverage.py ran on another worker (pytest-xdist shares nothing between workers).
    _, result = shared_runs("model=gpt")
    assert result["status"] == "ok", result.get("error")
    for path in OBJECTIVES:
        value = result_at(result, path)
        assert isinstance(value, float) and math.isfinite(value), (path, value)
        assert objective_value(result, path, "maximize") == value
        assert objective_value(result, f"-{path}", "minimize") == -value
    # a point that did not finish is the worst value for the direction, never an exception
    for status in ("oom", "failed", "diverged"):
        bad = {**result, "status": status}
        assert objective_value(bad, "throughput/samples_per_s", "maximize") == -math.inf
        assert objective_value(bad, "-memory/peak_allocated_mib_max", "minimize") == math.inf
    assert objective_value({}, "final_loss", None) == math.inf  # nothing ran: minimize is the default
    assert objective_value(result, None, "maximize") is None


def test_an_unknown_objective_names_the_allowed_ones():
    check_objective("-memory/peak_allocated_mib_max")
    with pytest.raises(ConfigError) as err:
        check_objective("throughput/samples")
    assert str(err.value).startswith("objective=throughput/samples is not a result.json number main can return; ")
    assert all(path in str(err.value) for path in OBJECTIVES)


def _hydra_config(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sharded_exp.compose import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


def test_launchers_that_cannot_host_ranks_are_refused_before_any_point(capsys):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    check_multirun(_hydra_config([]))  # the basic launcher
    check_multirun(_hydra_config(["hydra/launcher=submitit_local"]))
    with pytest.raises(SystemExit) as exit_:
        check_multirun(_hydra_config(["hydra/launcher=joblib"]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hydra/launcher=joblib (hydra_plugins.hydra_joblib_launcher.joblib_launcher."
                          "JoblibLauncher) cannot run this job's points")  # fmt: skip
    assert "hydra/launcher=submitit_local, hydra/launcher=submitit_slurm or the basic launcher" in err


def test_sweeper_settings_that_would_fail_every_point_are_refused(capsys):
    """A list of directions (Optuna's multi-objective study: main returns one number), and a
    number naming a precision in sweeper params (YAML: no command line to name it on)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    optuna = ["hydra/sweeper=optuna", "objective=final_loss"]
    check_multirun(_hydra_config([*optuna, "hydra.sweeper.direction=[maximize]"]))  # one objective, as a list
    assert sweeper_direction(_hydra_config([*optuna, "hydra.sweeper.direction=[maximize]"]).hydra) == "maximize"
    for overrides, message in (
        (["hydra.sweeper.direction=[maximize,minimize]"],
         "error: hydra.sweeper.direction=[maximize,minimize] asks for 2 objectives, and main returns one number "
         "(objective=final_loss): set hydra.sweeper.direction=maximize or hydra.sweeper.direction=minimize\n"),
        (["hparams_search=fastest", "hydra.sweeper.params.precision='choice(32,16)'"],
         "error: hydra.sweeper.params.precision=choice(32,16): the sweeper hands 32, 16 back to Hydra as numbers, "
         "which name no precision option; use the names: hydra.sweeper.params.precision=choice(fp32,fp16) "
         "(fp32 is 32, fp16 is 16)\n"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            check_multirun(_hydra_config([*optuna, *overrides]))
        assert exit_.value.code == 2
        assert capsys.readouterr().err == message
    check_multirun(_hydra_config(["hparams_search=fastest"]))  # its params name fp32


def test_an_optimizing_sweeper_needs_an_objective(capsys):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    check_multirun(_hydra_config(["hydra/sweeper=optuna", "objective=final_loss"]))
    with pytest.raises(SystemExit):
        check_multirun(_hydra_config(["hydra/sweeper=optuna"]))
    assert "error: hydra/sweeper=optuna optimizes the value main returns: set objective=" in capsys.readouterr().err


def test_a_sweep_directory_in_use_by_a_live_sweep_is_refused_before_its_first_point(tmp_path, capsys):
    """Two sweeps in one hydra.sweep.dir would overwrite each other's .sweep_id and report each
    other's points: the second is refused at its start (a second holder in this process stands
    for another live sweep: the lock is per open file); a lock left by a dead process is none."""
    from sharded_exp.report.command import ReportCallback

    config = _hydra_config([f"hydra.sweep.dir={tmp_path}"])
    first = ReportCallback()
    first.on_multirun_start(config)
    live_id = (tmp_path / ".sweep_id").read_text()
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(SystemExit) as exit_:
        ReportCallback().on_multirun_start(config)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"error: hydra.sweep.dir={tmp_path} is in use by a running sweep (pid {os.getpid()}); wait for it to end "
        "or choose another hydra.sweep.dir\n"
    )
    assert (tmp_path / ".sweep_id").read_text() == live_id  # the live sweep's points stay its own
    first.on_multirun_end(config)  # no point ran: no report; the directory is free again
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("999999999\n")  # a sweep killed with SIGKILL left its pid behind
    again = ReportCallback()
    again.on_multirun_start(config)
    assert (tmp_path / ".sweep_id").read_text() != live_id
    again.on_multirun_end(config)


def test_a_point_that_cannot_write_its_result_still_counts_as_failed(tmp_path, monkeypatch, capsys):
    """A sweep point whose pre-flight fails with an OSError records it in its result.json;
    where even that cannot be written (its run directory's filesystem), the point has no row
    in the report, so it is counted as failed on its own: the sweep exits 1, not 0."""
    import errno

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    import sharded_exp.__main__ as entry
    from sharded_exp.launch import parent
    from sharded_exp.report.command import ReportCallback

    point = tmp_path / "0_point"
    cfg = _hydra_config(["logger=none", f"hydra.sweep.dir={tmp_path}"])
    with open_dict(cfg):
        cfg.hydra.mode, cfg.hydra.runtime.output_dir = RunMode.MULTIRUN, str(point)
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parent, "launch", full)
    monkeypatch.setattr(parent, "record_config_error", full)
    monkeypatch.setattr(ReportCallback, "failed_points", 0)
    HydraConfig.instance().set_config(cfg)
    try:
        result = entry.check_and_launch(job)
    finally:
        HydraConfig.instance().cfg = None
    assert (result.status, result.error) == ("failed", "No space left on device")
    assert ReportCallback.failed_points == 1
    assert capsys.readouterr().err == (
        "error: No space left on device; the job did not run\n"
        f"error: {point}/result.json not written (No space left on device)\n"
    )


# ------------------------------------------------------------- precision, every syntax
def _points(args: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of a command line (its own parser and split)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(quote_numeric_choices(args))
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


@pytest.mark.parametrize(
    "args",
    [
        ["precision=32,16"],
        ["precision=choice(32,16)"],
        ["precision=choice(fp32,fp16)"],
    ],
)
def test_precision_sweeps_with_every_syntax(args):
    names = [str(_job(point).precision.name) for point in _points(args)]
    assert names == ["32", "16"]  # one name per precision in results, whichever option name was typed


def _job(point: list[str]):
    """A sweep's job composed as Hydra composes it: its overrides as the sweeper made them
    (no quote_numeric_choices: an unquoted 32 is an int there)."""
    return _hydra_config(point)


def test_precision_numbers_are_named_for_every_sweep_function():
    """Hydra's sort() and glob() and Optuna's choice() hand each pick back as an override
    (``precision=32``, an int Hydra refuses as a group choice): the numbers are named on the
    command line (32 -> fp32, 16 -> fp16), a glob becomes the names it matches, each once."""
    names = lambda args: [str(_job(point).precision.name) for point in _points(args)]  # noqa: E731
    assert quote_numeric_choices(["precision=16", "precision=choice(32,bf16)", "precision=sort(32,16)",
                                  "precision=glob(*)", "hydra.sweeper.params.precision='choice(32,16)'"]) == [
        "precision=fp16", "precision=choice(fp32,bf16)", "precision=sort(fp32,fp16)", "precision=bf16,fp16,fp32",
        "hydra.sweeper.params.precision='choice(fp32,fp16)'"]  # fmt: skip
    assert names(["precision=sort(32,16)"]) == ["16", "32"]
    assert names(["precision=glob(*)"]) == ["bf16", "16", "32"]
    assert names(["precision=glob(*,exclude=[16,32])"]) == ["bf16"]
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    space, fixed = create_params_from_overrides(quote_numeric_choices(["precision=choice(32,bf16)", "model=mlp"]))
    picks = [[f"precision={choice}", *(f"{k}={v}" for k, v in fixed.items())] for choice in space["precision"].choices]
    assert [str(_job(p).precision.name) for p in picks] == ["32", "bf16"]  # as Optuna's trials launch them


def test_precision_in_yaml_sweeper_params():
    """YAML sweeper params are not on the command line: the string names serve there (and
    in Optuna's choice(), which formats its pick back into an override: the slow sweep)."""
    params = OmegaConf.create(yaml.safe_load("params:\n  precision: fp32,fp16\n"))["params"]
    args = [f"{k}={v}" for k, v in params.items()]  # as Hydra's BasicSweeper turns params into overrides
    assert [str(compose(p).precision.name) for p in _points(args)] == ["32", "16"]


def test_precision_aliases_compose_as_their_option():
    for alias, option in (("fp32", "32"), ("fp16", "16")):
        assert compose([f"precision={alias}"]) == compose([f"precision={option}"])


# ------------------------------------------------------------------------- W&B Sweeps
def test_wandb_sweep_yaml_drives_the_same_jobs():
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    sweep = yaml.safe_load((ROOT / "examples" / "sweep.yaml").read_text())
    command = sweep["command"]
    assert command[:5] == ["${env}", "${interpreter}", "-m", "sharded_exp", "${args_no_hyphens}"]
    assert "logger.mode=online" in command and "logger=wandb" in command
    assert sweep["metric"]["name"] in [f"throughput/{k}" for k in ("samples_per_s", "tokens_per_s")]
    fixed = command[5:]
    params = sweep["parameters"]
    choices = {key: spec.get("values") or [spec["min"], spec["max"]] for key, spec in params.items()}
    for i in range(max(len(v) for v in choices.values())):  # every value of every parameter, in a few points
        point = {key: values[i % len(values)] for key, values in choices.items()}
        # the agent's own rendering of ${args_no_hyphens}, then our composition of it
        args = create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]
        cfg = OmegaConf.to_container(compose([*args, *fixed]))
        assert cfg["logger"]["mode"] == "online" and cfg["logger"]["name"] == "wandb"
        for key, value in point.items():
            got = result_at(cfg, key.replace(".", "/"))
            got = got["name"] if isinstance(got, dict) else got
            if key == "precision":  # results name a precision by one name (fp32 -> 32)
                value = str(compose([f"precision={value}"]).precision.name)
            assert got == value, (key, value, got)


# ---------------------------------------------------------------- real sweeps (slow)
@pytest.mark.slow
def test_optuna_sweep_finds_the_best_point_and_survives_oom(tmp_path):
    """4 trials (a 2 x 2 grid): two points get a 1 MiB budget and run out of memory; they
    return -inf (maximizing) and the study goes on to name the best of the others."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = run_cli(
        ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=4",
         "hydra.sweeper.direction=maximize", "objective=throughput/samples_per_s",
         "precision=choice(fp32,bf16)", "trainer.memory_limit_mib=choice(1,1000)", *SHRINK,
         f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = OmegaConf.load(tmp_path / "optimization_results.yaml")
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/result.json"))]
    assert len(results) == 4
    assert sorted(r["status"] for r in results) == ["ok", "ok", "oom", "oom"]
    ok = [r for r in results if r["status"] == "ok"]
    winner = max(ok, key=lambda r: r["throughput"]["samples_per_s"])
    assert best.best_value == pytest.approx(winner["throughput"]["samples_per_s"])
    assert best.best_params["trainer.memory_limit_mib"] == 1000
    assert compose([f"precision={best.best_params['precision']}"]).precision.name == winner["precision"]
    assert (tmp_path / "report.md").exists()


@pytest.mark.slow
def test_joblib_launcher_is_refused_before_the_first_point(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    proc = run_cli(["-m", "hydra/launcher=joblib", "strategy=ddp,zero1", *SHRINK, f"hydra.sweep.dir={tmp_path / 's'}"],
                   cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: hydra/launcher=joblib (" in proc.stderr and "cannot run this job's points" in proc.stderr
    assert not (tmp_path / "s").exists()  # no point started, no sweep directory


@pytest.mark.slow
def test_submitit_local_launcher_runs_points_and_returns_the_objective(tmp_path):
    proc = run_cli(
        ["-m", "hydra/launcher=submitit_local", "objective=-memory/peak_allocated_mib_max", "strategy=ddp,zero1",
         *SHRINK, f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {json.loads(p.read_text())["strategy"]: json.loads(p.read_text()) for p in tmp_path.glob("*/result.json")}
    assert sorted(results) == ["ddp", "zero1"] and all(r["status"] == "ok" for r in results.values())
    returned = []
    for path in tmp_path.glob(".submitit/*/*_result.pkl"):
        outcome, job_return = pickle.loads(path.read_bytes())
        assert outcome == "success"
        returned.append(job_return.return_value)
    peaks = [-r["memory"]["peak_allocated_mib_max"] for r in results.values()]
    assert sorted(returned) == pytest.approx(sorted(peaks))
