"""Checkpoints and resume with real ranks: bit-identical resume for every strategy,
cross-strategy and cross-world-size loading, atomic writes, and what a bad checkpoint
gets you (an error naming the file, before any rank starts)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from sharded_exp import checkpoint
from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from sharded_exp.strategies import STRATEGIES
from tests.helpers.disks import fill
from tests.helpers.jobs import ROOT, STRATEGY_NAMES, TINY, launch_job, read_result, run_cli, tiny
from tests.helpers.runs import cli


def consolidated_optimizer_state(path, scratch) -> tuple[dict, dict]:
    """(optim.pt's full state, meta.json's shapes) of a checkpoint in either format."""
    if checkpoint.read_meta(path)["checkpoint_format"] == "dcp":
        proc = run_cli(["export", str(path), str(scratch)], cwd=ROOT, module="sharded_exp.checkpoint")
        assert proc.returncode == 0, proc.stderr[-2000:]
        path = scratch
    saved = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
    return saved, json.loads(open(os.path.join(path, "meta.json")).read())["param_shapes"]


def final_state(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "model_final.pt", weights_only=True)


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


def test_every_strategy_has_its_yaml_and_every_yaml_its_strategy():
    # The tests parametrize over STRATEGY_NAMES: a strategy without a YAML would be skipped.
    yamls = sorted(p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml"))
    assert sorted(STRATEGY_NAMES) == yamls == sorted(STRATEGIES.names())
    assert {"ddp", "oss", "sharded_ddp", "zero1", "fsdp_grad_op", "fsdp"} <= set(STRATEGY_NAMES)


DEFAULT_TIER_RESUMES = {("ddp", "gpt", "consolidated"), ("fsdp", "gpt", "dcp")}
"""Both formats resumed in the default tier; every other combination in ``-m slow``."""


@pytest.mark.parametrize(
    "strategy, model, fmt",
    [
        pytest.param(s, m, f, marks=() if (s, m, f) in DEFAULT_TIER_RESUMES else pytest.mark.slow)
        for s in STRATEGY_NAMES
        for m in ("mlp", "gpt")
        for f in ("dcp", "consolidated")
    ],
)
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, strategy, model, fmt):
    common = [
        f"strategy={strategy}",
        "trainer.steps=6",
        "trainer.save_final_state=true",
        f"trainer.checkpoint_format={fmt}",
    ]
    if model == "gpt":
        common.append("model=gpt")
    straight = launch_job(common, tmp_path / "straight")
    assert straight["status"] == "ok", straight["error"]

    # Stopped at step 3 (a shorter run that checkpoints), then resumed to step 6.
    run = tmp_path / "interrupted"
    first = launch_job([*common, "trainer.steps=3", "trainer.checkpoint_every=3"], run)
    assert first["status"] == "ok", first["error"]
    assert first["checkpoint"] == str(run / "checkpoints" / "step_00000003")
    second = launch_job([*common, "trainer.resume=auto"], run)
    assert second["status"] == "ok", second["error"]
    assert (second["start_step"], second["steps_done"]) == (3, 6)
    assert second["resumed_from"] == first["checkpoint"]
    assert_bit_identical(final_state(tmp_path / "straight"), final_state(run))


def test_checkpoint_from_sharded_ddp_resumes_under_ddp(tmp_path):
    # Same world size: parity within the strategies' own tolerance (they are not bitwise).
    common = ["trainer.steps=6", "trainer.save_final_state=true"]
    launch_job(["strategy=sharded_ddp", *common], tmp_path / "straight")
    launch_job(["strategy=sharded_ddp", *common, "trainer.steps=3", "trainer.checkpoint_every=3"], tmp_path / "a")
    resumed = launch_job(
        ["strategy=ddp", *common, f"trainer.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000003'}"], tmp_path / "b"
    )
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["start_step"] == 3
    ref, got = final_state(tmp_path / "straight"), final_state(tmp_path / "b")
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_checkpoint_from_fsdp_at_two_ranks_loads_into_zero1_at_three(tmp_path):
    first = launch_job(["strategy=fsdp", "model=gpt", "trainer.steps=3", "trainer.checkpoint_every=3"], tmp_path / "a")
    assert first["status"] == "ok", first["error"]
    resumed = launch_job(
        [
            "strategy=zero1",
            "model=gpt",
            "trainer.world_size=3",
            "trainer.steps=4",
            "trainer.checkpoint_every=4",
            f"trainer.resume={first['checkpoint']}",
        ],
        tmp_path / "b",
    )
    assert resumed["status"] == "ok", resumed["error"]
    # The loaded optimizer state continued: Adam's step count is 4 for every tensor (a
    # fresh optimizer would be at 1), and the moments kept their full shapes. zero1 writes
    # dcp by default: read it through the export command's consolidated files.
    assert checkpoint.read_meta(first["checkpoint"])["checkpoint_format"] == "dcp"
    saved, shapes = consolidated_optimizer_state(resumed["checkpoint"], tmp_path / "exported")
    assert set(saved["state"]) == set(shapes)
    for name, state in saved["state"].items():
        assert float(state["step"]) == 4.0, name
        assert list(state["exp_avg"].shape) == shapes[name]
    meta = checkpoint.read_meta(resumed["checkpoint"])
    assert (meta["strategy"], meta["world_size"], meta["step"]) == ("zero1", 3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, written", [("consolidated", "model.pt"), ("dcp", ".metadata")])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, fmt, written):
    run = tmp_path / "run"
    args = [
        "trainer.steps=6",
        "trainer.checkpoint_every=2",
        "trainer.save_final_state=true",
        f"trainer.checkpoint_format={fmt}",
    ]
    # Rank 0 dies in the middle of the step-4 checkpoint: consolidated after model.pt,
    # dcp after every rank's shard files, before train.pt and meta.json.
    killed = launch_job(args, run, env={"SHARDED_EXP_FAULT": "rank=0,step=4,kind=exit_in_save"})
    assert killed["status"] == "failed"
    ckpts = run / "checkpoints"
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpts))] == [2]
    assert killed["checkpoint"] == str(ckpts / "step_00000002")  # the newest complete one, not null
    (half,) = ckpts.glob(".step_00000004.tmp.*")  # the half-written one, named for its job
    assert (half / written).exists() and not (half / "meta.json").exists()
    checkpoint.read_meta(str(ckpts / "step_00000002"))  # complete and readable

    resumed = launch_job([*args, "trainer.resume=auto"], run)
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["start_step"] == 2
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpts))] == [2, 4, 6]
    straight = launch_job(args[:1] + ["trainer.save_final_state=true"], tmp_path / "straight")
    assert straight["status"] == "ok"
    assert_bit_identical(final_state(tmp_path / "straight"), final_state(run))


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    result = launch_job(["trainer.steps=6", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"], tmp_path)
    assert result["status"] == "ok", result["error"]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "checkpoints"))] == [5, 6]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    result = launch_job(["trainer.steps=3", "trainer.resume=auto"], tmp_path)
    assert result["status"] == "ok", result["error"]
    assert (result["start_step"], result["resumed_from"]) == (0, None)


# --------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real checkpoint at step 3 (MLP, Adam), shared by the bad-input tests."""
    out = tmp_path_factory.mktemp("saved")
    result = launch_job(["trainer.steps=3", "trainer.checkpoint_every=3"], out)
    assert result["status"] == "ok", result["error"]
    return out / "checkpoints" / "step_00000003"


def start(overrides, out):
    from sharded_exp.launch.parent import launch

    return launch(compose(tiny(overrides)), str(out)).as_written()


def test_missing_checkpoint_is_named(tmp_path):
    missing = tmp_path / "nope" / "step_00000003"
    with pytest.raises(ConfigError, match=f"trainer.resume={missing}: no such checkpoint directory"):
        start([f"trainer.resume={missing}"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_corrupt_checkpoint_file_is_named(tmp_path, saved):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in checkpoint.FILES["consolidated"]:
        (bad / name).write_bytes((saved / name).read_bytes())
    (bad / "optim.pt").write_bytes((saved / "optim.pt").read_bytes()[:1000])  # truncated
    with pytest.raises(ConfigError, match=f"checkpoint file {bad / 'optim.pt'} is corrupt"):
        start([f"trainer.resume={bad}"], tmp_path / "out")
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"checkpoint file {bad / 'meta.json'} is corrupt"):
        start([f"trainer.resume={bad}"], tmp_path / "out")
    (bad / "train.pt").unlink()
    with pytest.raises(ConfigError, match=f"checkpoint {bad} is incomplete: train.pt is missing"):
        start([f"trainer.resume={bad}"], tmp_path / "out")


@pytest.mark.slow
def test_corrupt_dcp_checkpoint_is_named_without_reading_tensors(tmp_path):
    first = launch_job(["strategy=fsdp", "trainer.steps=3", "trainer.checkpoint_every=3"], tmp_path / "a")
    assert first["status"] == "ok", first["error"]
    good = first["checkpoint"]
    assert checkpoint.read_meta(good)["checkpoint_format"] == "dcp"
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    shard = sorted(bad.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated shard file
    with pytest.raises(ConfigError, match=f"checkpoint file {shard} is missing or truncated"):
        start(["strategy=fsdp", f"trainer.resume={bad}"], tmp_path / "out")
    (bad / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=f"checkpoint file {bad / '.metadata'} is corrupt or unreadable"):
        start(["strategy=fsdp", f"trainer.resume={bad}"], tmp_path / "out")
    (bad / ".metadata").unlink()
    with pytest.raises(ConfigError, match=f"checkpoint {bad} is incomplete: .metadata is missing"):
        start(["strategy=fsdp", f"trainer.resume={bad}"], tmp_path / "out")


def test_checkpoint_of_another_model_is_refused(tmp_path, saved):
    with pytest.raises(
        ConfigError, match=r"is from a different model \(model=mlp.*body\.0\.0\.weight is \[32, 64\] there"
    ):
        start([f"trainer.resume={saved}", "model.hidden=48"], tmp_path / "out")
    with pytest.raises(ConfigError, match="is from a different model"):
        start([f"trainer.resume={saved}", "model=gpt"], tmp_path / "out")


def test_checkpoint_of_another_optimizer_is_refused(tmp_path, saved):
    with pytest.raises(ConfigError, match="holds adam state; optimizer=sgd cannot load it"):
        start([f"trainer.resume={saved}", "optimizer=sgd"], tmp_path / "out")


def test_checkpoint_past_the_last_step_is_refused(tmp_path, saved):
    with pytest.raises(ConfigError, match=r"is at step 3, not before trainer.steps=3"):
        start([f"trainer.resume={saved}", "trainer.steps=3"], tmp_path / "out")


@pytest.mark.slow
def test_cli_bad_checkpoint_exits_2_and_keeps_the_directory(tmp_path, saved):
    # A good run, then a bad start in the same directory: nothing of the first is touched.
    run = tmp_path / "run"
    ok = run_cli([*TINY, "trainer.steps=3", "trainer.checkpoint_every=3", f"hydra.run.dir={run}"], cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.suffix != ".log"}
    bad = run_cli([*TINY, "model.hidden=48", "trainer.resume=auto", f"hydra.run.dir={run}"], cwd=ROOT)
    assert bad.returncode == 2
    assert "is from a different model" in bad.stderr and "step_00000003/meta.json" in bad.stderr
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.suffix != ".log"}
    assert after == before


@pytest.mark.slow
def test_a_failed_run_in_a_reused_directory_moves_the_earlier_records_aside(tmp_path):
    run = tmp_path / "run"
    ok = run_cli([*TINY, "trainer.steps=3", "trainer.checkpoint_every=3", f"hydra.run.dir={run}"], cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    result_before = (run / "result.json").read_bytes()
    config_before = (run / ".hydra" / "config.yaml").read_bytes()
    ckpt_before = (run / "checkpoints" / "step_00000003" / "model.pt").read_bytes()
    failed = run_cli(
        [*TINY, "trainer.resume=auto", f"hydra.run.dir={run}"],
        cwd=ROOT,
        env={"SHARDED_EXP_FAULT": "rank=1,step=4,kind=raise"},
    )
    assert failed.returncode == 1
    assert read_result(run)["status"] == "failed"
    assert (run / "attempts" / "1" / "result.json").read_bytes() == result_before
    assert (run / "attempts" / "1" / ".hydra" / "config.yaml").read_bytes() == config_before
    assert (run / "checkpoints" / "step_00000003" / "model.pt").read_bytes() == ckpt_before


# ---------------- resume settings, full disks and checkpoint directories shared by jobs
@pytest.mark.slow
def test_resume_takes_hyperparameters_from_the_config_and_records_the_changes(tmp_path):
    first = launch_job(["trainer.steps=3", "trainer.checkpoint_every=3", "optimizer.lr=0.001"], tmp_path / "a")
    ckpt = first["checkpoint"]
    runs = {}
    for lr in ("0.1", "0.001"):
        out = tmp_path / f"lr{lr}"
        proc = cli(["trainer.steps=6", "trainer.checkpoint_every=3", f"optimizer.lr={lr}",
                    f"trainer.resume={ckpt}", *TINY], out)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[lr] = (read_result(out), proc.stderr)
    changed, stderr = runs["0.1"]
    # both parameter groups (decayed and not) had lr 0.001 in the checkpoint
    assert [c for c in changed["resume_changes"] if c["key"] == "lr"] == [
        {"group": 0, "key": "lr", "checkpoint": 0.001, "config": 0.1},
        {"group": 1, "key": "lr", "checkpoint": 0.001, "config": 0.1},
    ]
    assert "warning: resuming with optimizer group 0 lr=0.1 from the config (the checkpoint has 0.001)" in stderr
    assert runs["0.001"][0]["resume_changes"] == []
    # a sweep of learning rates from one checkpoint gives different points
    assert changed["param_digest"] != runs["0.001"][0]["param_digest"]
    # and the next checkpoint holds the configured value
    saved = torch.load(os.path.join(changed["checkpoint"], "optim.pt"), weights_only=True)
    assert {g["lr"] for g in saved["param_groups"]} == {0.1}


@pytest.mark.slow
def test_resume_auto_on_a_finished_job_exits_0_and_changes_nothing(tmp_path):
    args = [*TINY, "trainer.steps=3", "trainer.checkpoint_every=3"]
    assert cli(args, tmp_path).returncode == 0
    before = (tmp_path / "result.json").read_bytes()
    proc = cli([*args, "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this job is done, nothing to do" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "result.json").read_bytes() == before and not (tmp_path / "attempts").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda m: m.pop("param_shapes"), "keys missing: param_shapes"),
        (lambda m: m.update(step="3"), "wrong type or value: step"),
        (lambda m: m.update(param_shapes=[[3, 4]]), "wrong type or value: param_shapes"),
        ("list", "has format 'list'"),
        ("swap", "model.pt is corrupt: it does not hold a model state dict"),
    ],
)
def test_malformed_checkpoints_are_named_corrupt(saved, tmp_path, damage, message):
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    meta = json.loads((bad / "meta.json").read_text())
    if damage == "list":
        (bad / "meta.json").write_text(json.dumps([meta]))
    elif damage == "swap":
        (bad / "model.pt").rename(bad / "tmp")
        (bad / "optim.pt").rename(bad / "model.pt")
        (bad / "tmp").rename(bad / "optim.pt")
    else:
        damage(meta)
        (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="checkpoint") as err:
        start(["trainer.steps=6", f"trainer.resume={bad}"], tmp_path / "out")
    assert message in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [["trainer.checkpoint_format=consolidated"],
     ["strategy=fsdp", "trainer.checkpoint_format=dcp"],
     ["strategy=fsdp", "trainer.checkpoint_format=dcp", "trainer.checkpoint_async=true"]],
    ids=["consolidated", "dcp", "dcp-async"],
)  # fmt: skip
def test_a_checkpoint_directory_that_fills_up_mid_run_keeps_the_last_checkpoint(how, small_fs, tmp_path):
    """One line naming the full disk, no temporary directory left, the previous checkpoint
    intact and named in result.json (DCP's CheckpointException and the zip writer's
    "unexpected pos" included)."""
    launch_job([*how, "trainer.steps=2", "trainer.checkpoint_every=2"], tmp_path / "probe")
    size = sum(p.stat().st_size for p in (tmp_path / "probe" / "checkpoints").rglob("*") if p.is_file())
    fill(small_fs, int(1.5 * size) + 8192)  # room for one checkpoint, not two
    run = tmp_path / "run"
    proc = cli([*TINY, *how, "trainer.steps=6", "trainer.checkpoint_every=2",
                f"trainer.checkpoint_dir={small_fs / 'ckpt'}"], run)  # fmt: skip
    assert proc.returncode == 1
    result = read_result(run)
    assert result["status"] == "failed"
    assert "no space left on device while writing " + str(small_fs / "ckpt") in result["error"], result["error"]
    assert "\n" not in result["error"] and "CheckpointException" not in result["error"]
    assert [p.name for p in (small_fs / "ckpt").iterdir() if p.name != ".lock"] == ["step_00000002"]
    checkpoint.read_meta(str(small_fs / "ckpt" / "step_00000002"))  # the previous one is intact
    assert result["checkpoint"] == str(small_fs / "ckpt" / "step_00000002")


@pytest.mark.slow
def test_a_save_that_never_finished_is_cleaned_by_the_next_job_in_its_directory(tmp_path):
    ckpts = tmp_path / "ckpts"
    args = ["trainer.steps=2", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={ckpts}"]
    assert start(args, tmp_path / "first")["status"] == "ok"
    killed = ckpts / ".step_00000004.tmp.123-abc"  # what a job killed mid-save leaves
    killed.mkdir()
    (killed / "model.pt").write_bytes(b"half")
    resume = ["trainer.steps=4", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={ckpts}", "trainer.resume=auto"]
    assert start(resume, tmp_path / "second")["status"] == "ok"
    assert sorted(p.name for p in ckpts.iterdir() if p.name != ".lock") == ["step_00000002", "step_00000004"]


def test_later_checkpoints_of_another_trajectory_are_refused_or_archived(tmp_path):
    first = tmp_path / "first"
    ckpts = tmp_path / "ckpts"
    args = ["trainer.steps=4", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={ckpts}"]
    assert start(args, first)["status"] == "ok"
    old_four = (ckpts / "step_00000004" / "meta.json").read_bytes()
    resume = [*args, f"trainer.resume={ckpts / 'step_00000002'}", "optimizer.lr=0.01"]
    # Refused before anything is written: the later step is named, and the ways out.
    with pytest.raises(ConfigError, match=r"already holds step_00000004.*trainer.existing_checkpoints=archive"):
        start(resume, tmp_path / "second")
    assert not (tmp_path / "second").exists()
    # A fresh run into the same directory would meet steps 2 and 4: refused as well.
    with pytest.raises(ConfigError, match="step_00000002, step_00000004"):
        start(args, tmp_path / "third")
    # Archived on request: the new step 4 is this trajectory's, and result.json names it.
    result = start([*resume, "trainer.existing_checkpoints=archive"], tmp_path / "second")
    assert result["status"] == "ok", result["error"]
    assert result["checkpoint"] == str(ckpts / "step_00000004")
    assert (ckpts / "archived" / "1" / "step_00000004" / "meta.json").read_bytes() == old_four
    assert (ckpts / "step_00000004" / "meta.json").read_bytes() != old_four
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpts))] == [2, 4]


def test_a_checkpoint_directory_is_held_by_one_job(tmp_path):
    from sharded_exp.checkpoint.storage import hold_checkpoint_dir
    from sharded_exp.launch.run_dir import release_run_dir

    ckpts = tmp_path / "ckpts"
    held = hold_checkpoint_dir(str(ckpts))  # as a live job holds it
    try:
        with pytest.raises(ConfigError, match=r"trainer.checkpoint_dir=.*ckpts is in use by a running job \(pid"):
            start(["trainer.steps=2", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={ckpts}"], tmp_path / "b")
        assert not (tmp_path / "b" / "result.json").exists()
    finally:
        release_run_dir(held)
    # A file, or a directory that cannot be written: said before any rank starts.
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        start(["trainer.resume=auto", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={tmp_path / 'file'}"],
               tmp_path / "c")  # fmt: skip


class _Planted:
    """What a planted .metadata would run on unpickling: here, touching a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_dcp_metadata_file_is_never_unpickled_beyond_dcps_own_classes(tmp_path):
    """DCP unpickles .metadata with plain pickle; the parent reads it through an unpickler that
    refuses any other class, so a planted file runs nothing before the refusal."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from sharded_exp.checkpoint.storage import read_dcp_metadata

    real = tmp_path / "real"
    dcp.save({"model.w": torch.ones(3, 2)}, checkpoint_id=str(real), no_dist=True)
    assert list(read_dcp_metadata(str(real)).state_dict_metadata["model.w"].size) == [3, 2]
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(pickle.UnpicklingError, match="io.open is not a part of dcp's metadata"):
        read_dcp_metadata(str(planted))
    assert not marker.exists()
    # A dotted name is looked up attribute by attribute: an admitted module's os.system.
    module, name = b"torch.distributed.checkpoint.filesystem", b"os.system"
    dotted = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
              + b"\x8c" + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + b"\x85R.")  # fmt: skip
    (planted / ".metadata").write_bytes(dotted)
    with pytest.raises(pickle.UnpicklingError, match="filesystem.os.system is not a part of dcp's metadata"):
        read_dcp_metadata(str(planted))
    assert not marker.exists()


class _PlantedEntry:
    """A checkpoint entry whose unpickling makes a directory (and returns None: picklable)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_dcp_checkpoint_with_a_pickled_entry_is_refused_before_dcp_unpickles_it(tmp_path, capsys):
    """DCP reads a non-tensor entry back with torch.load(weights_only=False); our checkpoints
    hold tensors only, so one that holds another entry is refused by resume and by export
    before DCP loads anything (without the check, export runs the entry's code: shown first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from sharded_exp.checkpoint.export import main as export

    golden = ROOT / "tests" / "regression" / "golden" / "checkpoints" / "formats" / "ddp" / "dcp" / "step_00000003"
    dcp_to_torch_save(str(golden), str(tmp_path / "flat.pt"))
    state = torch.load(tmp_path / "flat.pt", weights_only=True)
    planted, marker = tmp_path / "planted", tmp_path / "ran"
    planted.mkdir()
    for name in ("meta.json", "train.pt"):
        shutil.copyfile(golden / name, planted / name)
    dcp.save({**state, "extra": _PlantedEntry(str(marker))}, checkpoint_id=str(planted), no_dist=True)
    dcp_to_torch_save(str(planted), str(tmp_path / "unchecked.pt"))  # DCP alone: the entry's code runs
    assert marker.is_dir()
    marker.rmdir()

    with pytest.raises(
        checkpoint.CheckpointError, match=r"holds non-tensor entries \(extra\), which DCP would unpickle"
    ):
        checkpoint.read_meta(str(planted))
    assert export(["export", str(planted), str(tmp_path / "out")]) == 2
    assert "holds non-tensor entries (extra)" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
    checkpoint.read_meta(str(golden))  # the product's own: tensors only
