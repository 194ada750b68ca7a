"""sharded_exp.checkpoint.plan: the parent's checkpoint plan -- the format and directory it
decides, the checkpoint it resumes, what it refuses (incompatible checkpoints, a finished job,
later checkpoints of another trajectory) and what it archives."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from sharded_exp.checkpoint.plan import (
    CheckpointPlan,
    archive_later,
    check_compatible,
    plan_checkpoints,
    resolve_resume,
    resume_step,
)
from sharded_exp.checkpoint.storage import CheckpointError, complete_checkpoints
from sharded_exp.config import TrainerConfig
from sharded_exp.errors import ConfigError, NothingToDo

SHAPES = {"w": (2, 3)}  # what the conftest's write_checkpoint records


def trainer(**values):
    """trainer config as composed (the schema's types: enums for the options)."""
    return OmegaConf.merge(OmegaConf.structured(TrainerConfig), values)


def plan(tmp_path, default_format="consolidated", optimizer="adam", shapes=SHAPES, **values) -> CheckpointPlan:
    values.setdefault("checkpoint_dir", str(tmp_path / "ckpt"))
    return plan_checkpoints(trainer(**values), default_format, str(tmp_path / "run"), shapes, optimizer)


# ------------------------------------------------------------------ format, directory
def test_auto_format_takes_the_strategys_default(tmp_path):
    assert plan(tmp_path, default_format="dcp", checkpoint_format="auto").format == "dcp"
    assert plan(tmp_path, default_format="consolidated", checkpoint_format="auto").format == "consolidated"


def test_an_explicit_format_overrides_the_strategys_default(tmp_path):
    assert plan(tmp_path, default_format="dcp", checkpoint_format="consolidated").format == "consolidated"


def test_asynchronous_saves_need_the_dcp_format(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint_async=true needs trainer.checkpoint_format=dcp"):
        plan(tmp_path, default_format="consolidated", checkpoint_async=True)
    assert plan(tmp_path, default_format="dcp", checkpoint_async=True).asynchronous is True


def test_the_directory_defaults_to_checkpoints_in_the_run_directory(tmp_path):
    got = plan(tmp_path, checkpoint_dir=None)
    assert got.directory == os.path.join(str(tmp_path), "run", "checkpoints")


def test_a_relative_directory_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan(tmp_path, checkpoint_dir="rel/ck").directory == str(tmp_path / "rel" / "ck")


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "ckpt").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        plan(tmp_path)


def test_the_plan_carries_the_trainer_settings(tmp_path):
    got = plan(tmp_path, checkpoint_every=4, keep_checkpoints=3, existing_checkpoints="archive")
    assert (got.every, got.keep, got.existing, got.resume, got.start_step) == (4, 3, "archive", None, 0)
    assert got.config_values() == {
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_format": "consolidated",
        "resume": None,
    }


# -------------------------------------------------------------------------- resuming
def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 10)
    newest = write_checkpoint(tmp_path / "ckpt", 20)
    (tmp_path / "ckpt" / "step_00000030").mkdir()  # unfinished: no meta.json
    got = plan(tmp_path, resume="auto", steps=35, checkpoint_every=10)
    assert (got.resume, got.start_step) == (newest, 20)


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    got = plan(tmp_path, resume="auto")
    assert (got.resume, got.start_step) == (None, 0)


def test_resume_from_a_path_starts_at_its_step(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "elsewhere", 6)
    got = plan(tmp_path, resume=path, steps=10)
    assert (got.resume, got.start_step) == (path, 6)


def test_resume_auto_on_a_finished_job_is_nothing_to_do(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 10)
    with pytest.raises(NothingToDo, match="step 10 of trainer.steps=10"):
        plan(tmp_path, resume="auto", steps=10)


def test_resume_auto_one_step_before_the_end_is_planned(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "ckpt", 9)
    assert plan(tmp_path, resume="auto", steps=10).resume == path


def test_an_explicit_resume_at_the_last_step_is_refused_not_nothing_to_do(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "elsewhere", 10)
    with pytest.raises(ConfigError, match="not before trainer.steps=10") as caught:
        plan(tmp_path, resume=path, steps=10)
    assert not isinstance(caught.value, NothingToDo)


def test_a_missing_resume_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        plan(tmp_path, resume=str(tmp_path / "gone"))


def test_a_corrupt_checkpoint_to_resume_is_a_config_error(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "elsewhere", 3)
    os.remove(os.path.join(path, "model.pt"))
    with pytest.raises(ConfigError, match="model.pt is missing"):
        plan(tmp_path, resume=path, steps=10)


def test_a_checkpoint_of_another_model_is_refused(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "elsewhere", 3)
    with pytest.raises(ConfigError, match="from a different model"):
        plan(tmp_path, resume=path, steps=10, shapes={"w": (3, 2)})


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path / "elsewhere", 3)
    with pytest.raises(ConfigError, match="holds adam state; optimizer=sgd cannot load it"):
        plan(tmp_path, resume=path, steps=10, optimizer="sgd")


# ------------------------------------------------------- later checkpoints: refuse
def test_a_fresh_run_that_saves_refuses_checkpoints_already_in_its_directory(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 5)
    with pytest.raises(ConfigError, match="already holds step_00000005, later than step 0"):
        plan(tmp_path, checkpoint_every=5)


def test_a_resume_that_would_continue_behind_a_later_checkpoint_is_refused(tmp_path, write_checkpoint):
    earlier = write_checkpoint(tmp_path / "ckpt", 10)
    write_checkpoint(tmp_path / "ckpt", 20)
    with pytest.raises(ConfigError, match="already holds step_00000020, later than step 10"):
        plan(tmp_path, resume=earlier, steps=30, checkpoint_every=10)


def test_resuming_the_newest_checkpoint_is_not_refused(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 10)
    newest = write_checkpoint(tmp_path / "ckpt", 20)
    assert plan(tmp_path, resume=newest, steps=30, checkpoint_every=10).start_step == 20


def test_later_checkpoints_are_not_refused_by_a_run_that_writes_none(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 5)
    assert plan(tmp_path, checkpoint_every=0).resume is None


def test_later_checkpoints_are_not_refused_when_they_are_to_be_archived(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path / "ckpt", 5)
    got = plan(tmp_path, checkpoint_every=5, existing_checkpoints="archive")
    assert got.existing == "archive" and got.start_step == 0


def test_the_refusal_names_at_most_four_later_checkpoints(tmp_path, write_checkpoint):
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(tmp_path / "ckpt", step)
    with pytest.raises(ConfigError) as caught:
        plan(tmp_path, checkpoint_every=1)
    assert "step_00000004, ..." in str(caught.value) and "step_00000005" not in str(caught.value)


# ------------------------------------------------------- later checkpoints: archive
def test_archive_moves_the_later_checkpoints_and_keeps_the_resumed_one(tmp_path, write_checkpoint):
    directory = tmp_path / "ckpt"
    earlier = write_checkpoint(directory, 10)
    write_checkpoint(directory, 20)
    write_checkpoint(directory, 30)
    p = plan(tmp_path, resume=earlier, steps=40, checkpoint_every=10, existing_checkpoints="archive")
    target = archive_later(p)
    assert target == str(directory / "archived" / "1")
    assert sorted(os.listdir(target)) == ["step_00000020", "step_00000030"]
    assert complete_checkpoints(str(directory)) == [(10, earlier)]
    # resume=auto now finds the resumed trajectory's checkpoint, not the archived ones
    assert resolve_resume("auto", str(directory)) == earlier


def test_a_second_archive_gets_the_next_number(tmp_path, write_checkpoint):
    directory = tmp_path / "ckpt"
    for run in (1, 2):
        write_checkpoint(directory, 5 * run)
        p = plan(tmp_path, checkpoint_every=5, existing_checkpoints="archive")
        assert archive_later(p) == str(directory / "archived" / str(run))


def test_archive_does_nothing_without_later_checkpoints(tmp_path, write_checkpoint):
    newest = write_checkpoint(tmp_path / "ckpt", 10)
    p = plan(tmp_path, resume=newest, steps=20, checkpoint_every=5, existing_checkpoints="archive")
    assert archive_later(p) is None
    assert not (tmp_path / "ckpt" / "archived").exists()


@pytest.mark.parametrize("every, existing", [(0, "archive"), (5, "refuse")])
def test_archive_only_when_saving_and_asked_to(tmp_path, write_checkpoint, every, existing):
    path = write_checkpoint(tmp_path / "ckpt", 10)
    p = CheckpointPlan(str(tmp_path / "ckpt"), "consolidated", every, 0, False, existing, None, 0)
    assert archive_later(p) is None
    assert os.path.isdir(path)


# ---------------------------------------------------------------------- the helpers
@pytest.mark.parametrize("resume", [None, "", "none", "null"])
def test_resolve_resume_reads_every_spelling_of_none_as_a_fresh_start(tmp_path, write_checkpoint, resume):
    write_checkpoint(tmp_path, 5)
    assert resolve_resume(resume, str(tmp_path)) is None


def test_resolve_resume_makes_a_path_absolute(tmp_path, write_checkpoint, monkeypatch):
    write_checkpoint(tmp_path, 5)
    monkeypatch.chdir(tmp_path)
    assert resolve_resume("step_00000005", "/unused") == str(tmp_path / "step_00000005")


def test_resume_step_is_zero_for_a_fresh_start_and_the_checkpoints_step_otherwise(tmp_path, write_checkpoint):
    assert resume_step(None) == 0
    assert resume_step(write_checkpoint(tmp_path, 12)) == 12


def _meta(**values):
    meta = {"param_shapes": {"a": [2, 3], "b": [4]}, "optimizer": "adam", "step": 5, "model": {"name": "mlp"}}
    meta.update(values)
    return meta


def test_check_compatible_accepts_a_fitting_checkpoint():
    check_compatible("/c", _meta(), {"a": (2, 3), "b": (4,)}, "adam", 6)


def test_check_compatible_names_the_parameter_whose_shape_differs():
    with pytest.raises(CheckpointError, match=r"parameter b is \[4\] there, \[5\] here"):
        check_compatible("/c", _meta(), {"a": (2, 3), "b": (5,)}, "adam", 6)


def test_check_compatible_names_missing_and_extra_parameters():
    with pytest.raises(CheckpointError, match=r"missing there: \['c'\], not in this model: \['b'\]"):
        check_compatible("/c", _meta(), {"a": (2, 3), "c": (4,)}, "adam", 6)


def test_check_compatible_names_the_model_and_its_tensor_count():
    with pytest.raises(CheckpointError, match=r"/c/meta.json is from a different model \(model=gpt, 2 tensors\)"):
        check_compatible("/c", _meta(model="gpt"), {"a": (2, 3)}, "adam", 6)


def test_check_compatible_refuses_a_checkpoint_at_or_past_the_last_step():
    check_compatible("/c", _meta(step=5), {"a": (2, 3), "b": (4,)}, "adam", 6)
    with pytest.raises(CheckpointError, match="at step 5, not before trainer.steps=5"):
        check_compatible("/c", _meta(step=5), {"a": (2, 3), "b": (4,)}, "adam", 5)
