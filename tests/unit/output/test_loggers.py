"""sharded_exp.output.loggers without W&B itself (a stand-in ``wandb`` module where one is
needed): the run's tags, the arguments of ``wandb.init``, a logger that gives up instead of
stopping training, which rank logs. The summary's names and the band over ranks are
tests/unit/vocabulary/test_wandb_names.py's."""

from __future__ import annotations

import sys
import threading
import types

import pytest
from omegaconf import OmegaConf

from sharded_exp.config import ActivationCheckpointing
from sharded_exp.output import loggers


def run_config(**trainer_and_strategy):
    trainer = {"world_size": 2, "activation_checkpointing": None, "compile": False}
    strategy = {"name": "fsdp", "replicate": 1, "cpu_offload": False}
    for key, value in trainer_and_strategy.items():
        (strategy if key in strategy else trainer)[key] = value
    return {"trainer": trainer, "strategy": strategy, "precision": {"name": "bf16"}, "model": {"name": "gpt"}}


class FakeRun:
    def __init__(self, fail=()):
        self.fail, self.logged, self.finished, self.metrics = set(fail), [], None, []
        self.summary = types.SimpleNamespace(update=self._update)
        self.summed = {}

    def _update(self, values):
        if "summary" in self.fail:
            raise RuntimeError("summary broke")
        self.summed.update(values)

    def define_metric(self, name, summary):
        self.metrics.append((name, summary))

    def log(self, metrics, step):
        if "log" in self.fail:
            raise ConnectionError("gone")
        self.logged.append((step, metrics))

    def finish(self, exit_code=0):
        self.finished = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording what ``wandb.init`` was given."""
    module = types.ModuleType("wandb")
    module.calls = []
    module.Settings = lambda **kw: kw

    def init(**kw):
        module.calls.append(kw)
        return FakeRun()

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


# ------------------------------------------------------------------------ tags
def test_tags_name_the_point_and_no_lever_when_none_is_on():
    assert loggers.run_tags(run_config()) == ["strategy:fsdp", "precision:bf16", "model:gpt", "world_size:2"]


def test_tags_name_each_lever_that_is_on():
    tags = loggers.run_tags(run_config(activation_checkpointing=ActivationCheckpointing.full, compile=True,
                                       replicate=2, cpu_offload=True, world_size=4))  # fmt: skip
    assert tags == ["strategy:fsdp", "precision:bf16", "model:gpt", "world_size:4", "ac:full", "compile", "hsdp:2",
                    "cpu_offload"]  # fmt: skip


def test_activation_checkpointing_none_and_no_replicate_are_no_levers():
    tags = loggers.run_tags(run_config(activation_checkpointing="none", replicate=None))
    assert not [t for t in tags if t.startswith(("ac:", "hsdp:"))]


# ------------------------------------------------------------------------ wandb.init
def test_init_wandb_run_passes_the_logger_config(fake_wandb, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = OmegaConf.create({"project": "p", "entity": "e", "group": "g", "tags": ["a"], "mode": None})
    loggers.init_wandb_run(cfg, job_type="train", name="n", config={"x": 1}, directory="/d", tags=["b"])
    (kw,) = fake_wandb.calls
    assert (kw["project"], kw["entity"], kw["group"], kw["job_type"], kw["name"], kw["dir"]) == (
        "p",
        "e",
        "g",
        "train",
        "n",
        "/d",
    )
    assert kw["tags"] == ["a", "b"] and kw["config"] == {"x": 1}
    assert kw["mode"] == "offline"  # nothing set: never online by surprise
    assert kw["id"] is None and kw["resume"] is None
    assert kw["settings"]["init_timeout"] == 15.0


def test_a_fixed_run_id_resumes_and_the_mode_comes_from_config_then_environment(fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    loggers.init_wandb_run(OmegaConf.create({}), job_type=None, name=None, config=None, directory="/d", run_id="r1")
    loggers.init_wandb_run(OmegaConf.create({"mode": "online"}), job_type=None, name=None, config=None, directory="/d")
    first, second = fake_wandb.calls
    assert first["id"] == "r1" and first["resume"] == "allow" and first["mode"] == "disabled"
    assert second["mode"] == "online"


# ------------------------------------------------------------------------ the job's logger
def test_only_rank_zero_of_a_wandb_job_logs(monkeypatch):
    monkeypatch.setattr(loggers, "init_wandb_run", lambda *a, **kw: FakeRun())
    cfg = OmegaConf.create({"name": "wandb", "job_type": "train", "run_name": None})
    assert type(loggers.build_logger(cfg, run_config(), "/out", rank=1)) is loggers.NullLogger
    assert (
        type(loggers.build_logger(OmegaConf.create({"name": "none"}), run_config(), "/out", rank=0))
        is loggers.NullLogger
    )
    logger = loggers.build_logger(cfg, run_config(), "/out", rank=0)
    assert isinstance(logger, loggers.WandbLogger) and ("loss", "min") in logger.run.metrics
    logger.log({"loss": 1.0}, step=3)
    logger.summary({"x": 2})
    run = logger.run
    logger.finish(exit_code=1)
    assert run.logged == [(3, {"loss": 1.0})] and run.summed == {"x": 2} and run.finished == 1
    assert logger.run is None
    logger.finish()  # twice: nothing left to finish


def test_a_logger_that_cannot_start_warns_and_training_goes_on(monkeypatch):
    def refuse(*a, **kw):
        raise ConnectionError("no network")

    monkeypatch.setattr(loggers, "init_wandb_run", refuse)
    with pytest.warns(UserWarning, match=r"W&B could not start \(ConnectionError: no network\)"):
        logger = loggers.WandbLogger(OmegaConf.create({"job_type": None, "run_name": None}), run_config(), "/out")
    assert logger.run is None
    logger.log({"loss": 1.0}, step=1)
    logger.summary({})
    logger.finish()


@pytest.mark.parametrize(
    ("what", "call"), [("log", lambda lg: lg.log({"a": 1}, 0)), ("summary", lambda lg: lg.summary({"a": 1}))]
)
def test_a_logger_that_fails_later_gives_up_once(monkeypatch, what, call):
    run = FakeRun(fail={what})
    monkeypatch.setattr(loggers, "init_wandb_run", lambda *a, **kw: run)
    logger = loggers.WandbLogger(OmegaConf.create({"job_type": None, "run_name": None}), run_config(), "/out")
    with pytest.warns(UserWarning, match="training goes on without it"):
        call(logger)
    assert logger.run is None
    call(logger)  # no second warning, no error


# ------------------------------------------------------------------------ started beside the first steps
def test_what_is_logged_while_the_tracker_starts_waits_and_goes_to_it_in_order(monkeypatch):
    go, started = threading.Event(), []
    run = FakeRun()

    def slow_start(*a, **kw):
        go.wait(timeout=30)  # still starting while the first steps log
        return run

    monkeypatch.setattr(loggers, "init_wandb_run", slow_start)
    cfg = OmegaConf.create({"name": "wandb", "job_type": "train", "run_name": None})
    logger = loggers.start_logger(cfg, run_config(), "/out", rank=0, on_started=started.append)
    logger.log({"loss": 2.0}, step=1)
    logger.log({"loss": 1.0}, step=2)
    assert run.logged == [] and started == []  # not started yet: nothing sent, and the steps did not wait
    go.set()
    logger.wait_started()
    assert len(started) == 1 and run.logged == [(1, {"loss": 2.0}), (2, {"loss": 1.0})]
    logger.log({"loss": 0.5}, step=3)  # once started, straight through
    logger.summary({"x": 2})
    logger.finish(exit_code=1)
    assert run.logged[-1] == (3, {"loss": 0.5}) and run.summed == {"x": 2} and run.finished == 1


def test_summary_and_finish_wait_for_a_tracker_still_starting(monkeypatch):
    go, run = threading.Event(), FakeRun()
    monkeypatch.setattr(loggers, "init_wandb_run", lambda *a, **kw: go.wait(timeout=30) and run)
    cfg = OmegaConf.create({"name": "wandb", "job_type": "train", "run_name": None})
    logger = loggers.start_logger(cfg, run_config(), "/out", rank=0, on_started=lambda t: None)
    logger.log({"loss": 1.0}, step=1)
    threading.Timer(0.2, go.set).start()
    logger.finish()  # waits for the start, then sends what waited and finishes
    assert run.logged == [(1, {"loss": 1.0})] and run.finished == 0


def test_a_rank_without_a_tracker_is_started_at_once():
    started = []
    logger = loggers.start_logger(OmegaConf.create({"name": "none"}), run_config(), "/out", rank=0,
                                  on_started=started.append)  # fmt: skip
    assert type(logger) is loggers.NullLogger and len(started) == 1


def test_a_tracker_that_never_starts_is_given_up_at_the_limit_and_training_goes_on(monkeypatch):
    never, run = threading.Event(), FakeRun()
    monkeypatch.setattr(loggers, "init_wandb_run", lambda *a, **kw: never.wait(timeout=30) and run)
    monkeypatch.setattr(loggers, "START_LIMIT_S", 0.2)
    cfg = OmegaConf.create({"name": "wandb", "job_type": "train", "run_name": None})
    logger = loggers.start_logger(cfg, run_config(), "/out", rank=0, on_started=lambda t: None)
    with pytest.warns(UserWarning, match="W&B had not started 0.2 s after it was asked to; training goes on"):
        logger.wait_started()
    logger.log({"loss": 1.0}, step=1)
    logger.summary({"x": 1})
    logger.finish()  # no second wait, no second warning
    never.set()
    assert run.logged == [] and run.finished is None


def test_a_finish_that_never_returns_is_given_up_at_the_limit_with_a_warning(monkeypatch):
    never, run = threading.Event(), FakeRun()
    run.finish = lambda exit_code=0: never.wait(timeout=30)
    monkeypatch.setattr(loggers, "init_wandb_run", lambda *a, **kw: run)
    monkeypatch.setattr(loggers, "FINISH_LIMIT_S", 0.2)
    logger = loggers.WandbLogger(OmegaConf.create({"job_type": None, "run_name": None}), run_config(), "/out")
    with pytest.warns(UserWarning, match="W&B's finish did not return within 0.2 s; the W&B run is left unfinished"):
        logger.finish()
    never.set()
    assert logger.run is None


def test_an_error_in_finish_reaches_the_caller():
    run = types.SimpleNamespace(finish=lambda exit_code=0: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        loggers.finish_run(run)
