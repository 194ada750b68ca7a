"""sharded_exp.sweep in-process: the objective main returns to a sweeper (its path into
result.json, negation, the worst value for a point that did not finish), the sweeper's
direction, the checks before a multirun's first point, and the sweep directory's lock.
Configs are plain OmegaConf objects shaped like Hydra's."""

from __future__ import annotations

import enum
import math
import os

import pytest
from omegaconf import OmegaConf

from sharded_exp import sweep
from sharded_exp.config import ReportConfig
from sharded_exp.errors import ConfigError

BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def multirun_config(launcher=BASIC, sweeper="hydra._internal.core_plugins.basic_sweeper.BasicSweeper", objective=None,
                    **sweeper_settings):  # fmt: skip
    return OmegaConf.create({
        "objective": objective,
        "hydra": {"launcher": {"_target_": launcher}, "sweeper": {"_target_": sweeper, **sweeper_settings},
                  "runtime": {"choices": {"hydra/launcher": "mine", "hydra/sweeper": "optuna"}}},
    })  # fmt: skip


RESULT = {
    "status": "ok",
    "final_loss": 0.25,
    "throughput": {"samples_per_s": 120.0, "mfu_pct": None, "steps": 7, "fused": True, "nan": math.nan},
    "memory": {"peak_allocated_mib_max": 4.5, "per_rank": [{"peak_allocated_mib": 4.0}, {"peak_allocated_mib": 4.5}]},
    "eval": {"final": {"eval/loss": 1.5}},
}


# ------------------------------------------------------------------------ the objective
def test_an_objective_must_name_a_result_number_negated_or_not():
    sweep.check_objective(None)
    sweep.check_objective("throughput/samples_per_s")
    sweep.check_objective("-memory/peak_allocated_mib_max")
    with pytest.raises(ConfigError, match=r"^objective=throughput/samples is not a result.json number"):
        sweep.check_objective("throughput/samples")
    with pytest.raises(ConfigError):
        sweep.check_objective("--final_loss")  # one minus only


def test_the_objective_is_the_number_at_its_path_negated_by_a_minus():
    assert sweep.objective_value(RESULT, "throughput/samples_per_s", "maximize") == 120.0
    assert sweep.objective_value(RESULT, "-memory/peak_allocated_mib_max", "maximize") == -4.5
    assert sweep.objective_value(RESULT, "eval/final/eval/loss", "minimize") == 1.5
    value = sweep.objective_value(RESULT, "throughput/steps", "maximize")
    assert value == 7.0 and type(value) is float
    assert sweep.objective_value(RESULT, None, "maximize") is None


@pytest.mark.parametrize("path", ["throughput/mfu_pct", "throughput/fused", "throughput/nan", "throughput/none"])
def test_a_missing_or_non_numeric_figure_is_the_worst_value(path):
    assert sweep.objective_value(RESULT, path, "maximize") == -math.inf
    assert sweep.objective_value(RESULT, path, "minimize") == math.inf
    assert sweep.objective_value(RESULT, f"-{path}", "maximize") == -math.inf  # worst stays worst when negated


@pytest.mark.parametrize("status", ["oom", "failed", "diverged", "stopped"])
def test_a_point_that_did_not_finish_is_the_worst_value_for_the_direction(status):
    bad = {**RESULT, "status": status}
    assert sweep.objective_value(bad, "throughput/samples_per_s", "maximize") == -math.inf
    assert sweep.objective_value(bad, "final_loss", "minimize") == math.inf
    assert sweep.objective_value(bad, "final_loss", None) == math.inf  # no direction: minimize


def test_result_at_follows_keys_and_list_indices():
    assert sweep.result_at(RESULT, "memory/per_rank/1/peak_allocated_mib") == 4.5
    assert sweep.result_at(RESULT, "memory/per_rank/2/peak_allocated_mib") is None  # past the last rank
    assert sweep.result_at(RESULT, "memory/per_rank/x") is None
    assert sweep.result_at(RESULT, "final_loss/deeper") is None
    assert sweep.result_at(RESULT, "nothing") is None
    assert sweep.result_at(RESULT, "memory") is RESULT["memory"]


def test_result_at_takes_the_longest_key_holding_a_slash():
    data = {"a/b": {"c": 1}, "a": {"b": {"c": 2}}, "x": {"y/z": 3}}
    assert sweep.result_at(data, "a/b/c") == 1
    assert sweep.result_at(data, "x/y/z") == 3


# ------------------------------------------------------------------------ the sweeper's direction
class Direction(enum.Enum):
    MAXIMIZE = 1
    MINIMIZE = 2


@pytest.mark.parametrize(
    ("direction", "expected"),
    [("maximize", "maximize"), ("Minimize", "minimize"), (["minimize"], "minimize"), (["maximize", "minimize"], None),
     (Direction.MAXIMIZE, "maximize"), (None, None)],
)  # fmt: skip
def test_the_sweepers_direction(direction, expected):
    assert sweep.sweeper_direction(OmegaConf.create({"sweeper": {"direction": direction}})) == expected


def test_a_sweeper_without_a_direction_or_no_sweeper():
    assert sweep.sweeper_direction(OmegaConf.create({"sweeper": {}})) is None
    assert sweep.sweeper_direction(OmegaConf.create({"launcher": {}})) is None


# ------------------------------------------------------------------------ checks before the first point
def test_several_directions_are_refused():
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.direction=\[maximize,minimize\] asks for 2 objectives"):
        sweep.check_sweeper(OmegaConf.create({"direction": ["maximize", "minimize"]}), "final_loss")
    sweep.check_sweeper(OmegaConf.create({"direction": ["maximize"]}), "final_loss")


def test_a_precision_named_by_a_number_in_the_sweepers_params_is_refused_with_its_name():
    with pytest.raises(ConfigError) as err:
        sweep.check_sweeper(OmegaConf.create({"params": {"precision": "choice(32,16,bf16)"}}), None)
    assert str(err.value).startswith("hydra.sweeper.params.precision=choice(32,16,bf16): the sweeper hands 32, 16 back")
    assert "use the names: hydra.sweeper.params.precision=choice(fp32,fp16,bf16) (fp32 is 32, fp16 is 16)" in str(
        err.value
    )
    sweep.check_sweeper(OmegaConf.create({"params": {"precision": "choice(fp32,bf16)",
                                                     "trainer.batch_size": "choice(16,32)"}}), None)  # fmt: skip


def test_a_launcher_that_can_host_ranks_passes(capsys):
    sweep.check_multirun(multirun_config())
    sweep.check_multirun(multirun_config(launcher=next(t for t, n in sweep.HOSTS.items() if n == "submitit_local")))
    assert capsys.readouterr().err == ""


def test_a_report_profile_that_names_no_gpu_is_refused_before_the_first_point(capsys):
    cfg = multirun_config()
    cfg.report = OmegaConf.structured(ReportConfig)
    sweep.check_multirun(cfg)
    cfg.report.device_profile = "h100"
    with pytest.raises(SystemExit) as exit_:
        sweep.check_multirun(cfg)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: report.device_profile=h100 is not a named GPU profile; use one of"
    )


def test_a_launcher_that_cannot_host_ranks_is_refused_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep.check_multirun(multirun_config(launcher="hydra_plugins.hydra_joblib_launcher.JoblibLauncher"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hydra/launcher=mine (hydra_plugins.hydra_joblib_launcher.JoblibLauncher) cannot run")
    assert "use hydra/launcher=submitit_local, hydra/launcher=submitit_slurm or the basic launcher" in err


def test_an_optimizing_sweeper_needs_an_objective(capsys):
    with pytest.raises(SystemExit) as exit_:
        sweep.check_multirun(multirun_config(sweeper=OPTUNA))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: hydra/sweeper=optuna optimizes the value main returns: set objective="
    )
    sweep.check_multirun(multirun_config(sweeper=OPTUNA, objective="-memory/peak_allocated_mib_max"))


def test_a_wrong_objective_or_sweeper_setting_exits_2(capsys):
    for config in (multirun_config(objective="loss"), multirun_config(direction=["maximize", "minimize"])):
        with pytest.raises(SystemExit) as exit_:
            sweep.check_multirun(config)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: objective=loss is not a result.json number" in err and "asks for 2 objectives" in err


# ------------------------------------------------------------------------ the sweep directory's lock
def test_a_held_sweep_directory_is_refused_and_released_on_the_sweeps_end(tmp_path, capsys):
    lock = sweep.hold_sweep_dir(tmp_path)
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(SystemExit) as exit_:
            sweep.hold_sweep_dir(tmp_path)  # another open of the lock: held
        assert exit_.value.code == 2
        assert f"is in use by a running sweep (pid {os.getpid()})" in capsys.readouterr().err
    finally:
        sweep.release_sweep_dir(lock)
    assert lock.closed and not (tmp_path / ".lock").exists()
    sweep.release_sweep_dir(lock)  # twice: nothing to do
    sweep.release_sweep_dir(None)
    sweep.release_sweep_dir(sweep.hold_sweep_dir(tmp_path))  # free again


def test_a_sweep_point_that_does_not_compose_is_refused_before_the_sweep_directory_is_touched(capsys):
    """Hydra composes its batch only after it has written multirun.yaml (and the report's callback
    the .sweep_id): a key that one swept strategy has and another lacks is refused first, naming
    the point; a sweep whose points all compose passes."""
    from hydra import compose, initialize_config_dir

    from sharded_exp.compose import CONF_DIR, register_schemas
    from sharded_exp.strategies import STRATEGIES

    register_schemas(query=True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["strategy=ddp", "strategy.bucket_cap_mb=5"], return_hydra_config=True)
        cfg.hydra.sweeper = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"}
        cfg.hydra.overrides.task = ["strategy=ddp,fsdp", "strategy.bucket_cap_mb=5", "trainer.steps=4,6"]
        sweep.check_multirun(cfg)  # a new sweep directory: Hydra's own check overwrites nothing there
        with pytest.raises(SystemExit) as exit_:
            sweep.check_multirun(cfg, reused=True)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == (
            "error: the sweep's point strategy=fsdp strategy.bucket_cap_mb=5 trainer.steps=4 does not compose: "
            "strategy.bucket_cap_mb is not a setting of strategy=fsdp; nothing was run or written (sweep the "
            "options that have it in a sweep of their own)\n"
        )
        cfg.hydra.overrides.task = ["strategy=ddp,zero1", "strategy.bucket_cap_mb=5", "trainer.steps=4,6"]
        assert len(sweep.sweep_points(cfg)) == 4
        sweep.check_multirun(cfg, reused=True)
        assert capsys.readouterr().err == ""
        # glob(...) needs Hydra's config loader to list the options (the README's first sweep)
        cfg.hydra.overrides.task = ["strategy=glob(*)", "trainer.steps=4"]
        assert sorted(p[0] for p in sweep.sweep_points(cfg)) == [f"strategy={s}" for s in STRATEGIES.names()]
        # a preset's sweep is the sweeper's params, expanded before the command line's
        cfg.hydra.sweeper = {"_target_": cfg.hydra.sweeper._target_, "params": {"strategy": "ddp,fsdp"}}
        cfg.hydra.overrides.task = ["strategy.bucket_cap_mb=5"]
        with pytest.raises(SystemExit):
            sweep.check_multirun(cfg, reused=True)
        assert "the sweep's point strategy=fsdp strategy.bucket_cap_mb=5 does not compose" in capsys.readouterr().err
