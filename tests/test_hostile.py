"""What a hostile pass found (issue 17), one test per item: nothing silent, nothing
orphaned, nothing half-written. Real processes, real signals, real files."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from sharded_exp import checkpoint
from sharded_exp.errors import ConfigError
from tests.conftest import ROOT, STRATEGY_NAMES, TINY, compose_cfg, read_result, run_cli, run_job, tiny
from tests.helpers.processes import LONG, descendants, finish, start_job, survivors, wait_until


def cli(args, tmp_path, env=None, timeout=240):
    return run_cli([*args, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, timeout=timeout)


def launch(overrides, out):
    from sharded_exp.launch.parent import launch as parent_launch

    return parent_launch(compose_cfg(tiny(overrides)), str(out))


def _rank_errors(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*_error.json"))]


# ------------------------------------------------------------- 1. resume hyperparameters
@pytest.mark.slow
def test_1_resume_takes_hyperparameters_from_the_config_and_records_the_changes(tmp_path):
    first = run_job(["trainer.steps=3", "trainer.checkpoint_every=3", "optimizer.lr=0.001"], tmp_path / "a")
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


# ------------------------------------------------------------- 2. diverged runs
def test_2_a_diverged_run_is_not_ok_and_gets_no_saving(tmp_path):
    proc = cli([*TINY, "trainer.steps=4"], tmp_path / "inf", env={"SHARDED_EXP_FAULT": "rank=1,step=1,kind=inf_grad"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = read_result(tmp_path / "inf")
    assert result["status"] == "diverged" and result["first_nonfinite_step"] == 3
    assert "diverged: final loss nan, loss first non-finite at step 3" in result["error"]
    assert "diverged" in proc.stderr

    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *TINY,
        "trainer.steps=4",
        "trainer.grad_clip=0",
        "optimizer.lr=0.001,1e30",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_cli(args, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "failed or diverged" in proc.stderr, proc.stderr[-3000:]
    rows = {r["status"]: r for r in csv.DictReader(open(sweep / "report.csv"))}
    assert set(rows) == {"ok", "diverged"}
    bad = rows["diverged"]
    assert bad["first_nonfinite_step"] and bad["speed_vs_baseline"] == bad["peak_saving_pct"] == ""
    assert bad["parity_vs_baseline"] == ""


# ------------------------------------------------------------- 3. signal deaths named
def test_3_a_rank_killed_by_a_signal_is_named_not_its_peer(tmp_path):
    proc = cli(LONG, tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=3,kind=kill"})
    assert proc.returncode == 1
    error = read_result(tmp_path)["error"]
    assert error.startswith("rank 1: killed by signal 9 (SIGKILL)"), error
    assert "OOM killer" in error


# ------------------------------------------------------------- 4. CPU allocation failure
@pytest.mark.slow
@pytest.mark.parametrize(
    "check, says",
    [("false", "can't allocate memory"), ("true", "of host memory")],
    ids=["the-allocator-fails", "refused-before-it-starts"],
)
def test_4_a_cpu_allocation_failure_is_oom_and_does_not_fail_the_sweep(check, says, tmp_path):
    """A point too large for the machine is a result (oom), whether the allocator says so
    or, with the host memory check on (22.12), the pre-flight does before any rank starts."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "trainer.steps=3", "trainer.batch_size=8,1000000000000",
                    f"trainer.host_memory_check={check}", f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    status = {p["config"]["trainer"]["batch_size"]: p for p in points}
    assert status[8]["status"] == "ok"
    assert status[10**12]["status"] == "oom" and says in status[10**12]["error"]


# ------------------------------------------------------------- 5. parent SIGKILL
@pytest.mark.slow
def test_5_ranks_exit_when_the_parent_is_killed(tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    proc = start_job([*LONG, "trainer.checkpoint_every=5", f"hydra.run.dir={run}"], log)
    wait_until((run / "checkpoints" / "step_00000005").exists, proc, log)
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # two ranks and the forkserver
    proc.kill()  # SIGKILL: the parent cannot pass anything on
    proc.wait()
    end = time.time() + 10
    while survivors(tree) and time.time() < end:
        time.sleep(0.2)
    assert not survivors(tree), survivors(tree)
    found = checkpoint.complete_checkpoints(str(run / "checkpoints"))
    time.sleep(1)
    assert checkpoint.complete_checkpoints(str(run / "checkpoints")) == found  # nobody trains on


# ------------------------------------------------------------- 6. one job per run directory
@pytest.mark.slow
def test_6_a_second_job_in_a_live_run_directory_is_refused(tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    proc = start_job([*LONG, f"hydra.run.dir={run}"], log)
    try:
        wait_until(lambda: (run / "result.json").exists(), proc, log)
        before = (run / "result.json").read_bytes()
        second = run_cli([*TINY, f"hydra.run.dir={run}"], cwd=ROOT)
        assert second.returncode == 2
        assert f"run directory {run} is in use by a running job (pid {proc.pid})" in second.stderr
        assert (run / "result.json").read_bytes() == before and not (run / "attempts").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc, log)


# ------------------------------------------------------------- 7. full disks
@pytest.fixture
def small_fs(tmp_path):
    """A real filesystem of 1 MiB (tmpfs), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory, leave_bytes: int) -> None:
    with open(directory / "filler", "wb") as f:
        free = shutil.disk_usage(directory).free
        f.write(bytes(max(0, free - leave_bytes)))


@pytest.mark.slow
def test_7_run_directory_on_a_full_disk(small_fs, tmp_path):
    fill(small_fs, 0)
    run = small_fs / "run"
    proc = run_cli([*TINY, f"hydra.run.dir={run}"], cwd=ROOT)
    assert proc.returncode in (1, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "no space left on device" in proc.stderr.lower(), proc.stderr[-2000:]
    leftovers = [p.name for p in run.rglob("*") if ".tmp" in p.name] if run.exists() else []
    assert leftovers == []


@pytest.mark.slow
def test_7_checkpoint_directory_fills_up_mid_run(small_fs, tmp_path):
    run_job(["trainer.steps=2", "trainer.checkpoint_every=2", "trainer.checkpoint_format=consolidated"],
                    tmp_path / "probe")  # fmt: skip
    size = sum(p.stat().st_size for p in (tmp_path / "probe" / "checkpoints").rglob("*") if p.is_file())
    fill(small_fs, int(1.5 * size) + 8192)  # room for one checkpoint, not two
    run = tmp_path / "run"
    proc = cli([*TINY, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.checkpoint_format=consolidated",
                f"trainer.checkpoint_dir={small_fs / 'ckpt'}"], run)  # fmt: skip
    assert proc.returncode == 1
    result = read_result(run)
    assert result["status"] == "failed"
    assert "no space left on device while writing " + str(small_fs / "ckpt") in result["error"], result["error"]
    assert [p.name for p in (small_fs / "ckpt").iterdir()] == ["step_00000002"]  # no temporary left
    checkpoint.read_meta(str(small_fs / "ckpt" / "step_00000002"))  # the previous one is intact


# ------------------------------------------------------------- 8. attempts numbering
def test_8_a_gap_in_attempts_takes_the_next_free_number(tmp_path):
    run_job(["trainer.steps=2"], tmp_path)
    (tmp_path / "attempts" / "2").mkdir(parents=True)  # 1 was deleted by hand
    result = run_job(["trainer.steps=2"], tmp_path)
    assert result["status"] == "ok"
    assert (tmp_path / "attempts" / "3" / "result.json").exists()


# ------------------------------------------------------------- 9. a signal at one rank only
@pytest.mark.slow
def test_9_sigterm_at_a_non_zero_rank_stops_the_job_with_its_signal(tmp_path):
    proc = cli(
        [*LONG, "trainer.checkpoint_every=1000"], tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=3,kind=sigterm"}
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "stopped by signal 15 after step" in proc.stderr and "None" not in proc.stderr
    result = read_result(tmp_path)
    assert result["status"] == "stopped" and result["signal"] == signal.SIGTERM
    assert result["checkpoint"] == str(tmp_path / "checkpoints" / f"step_{result['steps_done']:08d}")


# ------------------------------------------------------------- 10. malformed checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    run_job(["trainer.steps=3", "trainer.checkpoint_every=3"], out)
    return out / "checkpoints" / "step_00000003"


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
def test_10_malformed_checkpoints_are_named_corrupt(saved, tmp_path, damage, message):
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
        launch(["trainer.steps=6", f"trainer.resume={bad}"], tmp_path / "out")
    assert message in str(err.value)


# ------------------------------------------------------------- 11. model and optimizer values
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
def test_11_bad_model_and_optimizer_values_are_refused_before_spawn(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        launch(overrides, tmp_path / "out")
    assert message in str(err.value)


def test_11_cli_exit_2_without_a_traceback(tmp_path):
    proc = run_cli([*tiny(["model=gpt", "model.n_heads=0"]), f"hydra.run.dir={tmp_path / 'x'}"], cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()  # 15: no empty directory left behind


# ------------------------------------------------------------- 12. planner input
@pytest.mark.parametrize(
    "override, message",
    [
        ("plan.params=-1", "plan.params=-1.0 must be a finite number >= 1"),
        ("plan.params=nan", "plan.params=nan must be a finite number >= 1"),
        ("plan.world_sizes=[0]", "plan.world_sizes=[0] must be a non-empty list of integers >= 1"),
        ("plan.worldsizes=[2]", "Could not override 'plan.worldsizes'"),
        ("strategy=zero9", "Could not find 'strategy/zero9'"),
        ("plan.strategies=[zero9]", "unknown strategy 'zero9'"),
        ("plan.format=xml", "plan.format=xml"),
        ("plan.plot=plan.txt", "plan.plot=plan.txt must name a .png, .svg or .pdf file"),
    ],
)
@pytest.mark.slow
def test_12_the_planner_refuses_bad_input_with_exit_2(override, message):
    proc = run_cli([override], cwd=ROOT, module="sharded_exp.plan")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------- 13. bad points in a report
def test_13_a_bad_result_json_is_a_row_that_says_why(tmp_path):
    from sharded_exp.output.comparison import write_report

    sweep = tmp_path / "sweep"
    good = run_job(["trainer.steps=2"], sweep / "0_good")
    assert good["status"] == "ok"
    (sweep / "1_truncated").mkdir()
    (sweep / "1_truncated" / "result.json").write_text('{"status": "ok", "strat')
    (sweep / "2_running").mkdir()
    (sweep / "2_running" / "result.json").write_text('{"status": "running"}')
    rows = write_report(sweep)
    assert (sweep / "report.md").exists() and len(rows) == 3
    by_status = {r["status"]: r for r in rows}
    assert "1_truncated/result.json" in by_status["unreadable"]["error"]
    assert "still running or killed before it finished" in by_status["running"]["error"]
    assert by_status["ok"]["peak_allocated_mib_max"] > 0


# ------------------------------------------------------------- 14. requeue of a finished job
@pytest.mark.slow
def test_14_resume_auto_on_a_finished_job_exits_0_and_changes_nothing(tmp_path):
    args = [*TINY, "trainer.steps=3", "trainer.checkpoint_every=3"]
    assert cli(args, tmp_path).returncode == 0
    before = (tmp_path / "result.json").read_bytes()
    proc = cli([*args, "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this job is done, nothing to do" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert (tmp_path / "result.json").read_bytes() == before and not (tmp_path / "attempts").exists()


# ------------------------------------------------------------- 15. the small ones
@pytest.mark.slow
def test_15_run_directory_that_is_a_file_or_read_only(tmp_path, small_fs):
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = run_cli([*TINY, f"hydra.run.dir={afile}"], cwd=ROOT)
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    proc = run_cli([*TINY, f"hydra.run.dir={small_fs / 'run'}"], cwd=ROOT)
    assert proc.returncode == 2 and "cannot be written (Read-only file system)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_15_unknown_plugin_module(tmp_path):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env={"SHARDED_EXP_PLUGINS": "no_such_module"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "SHARDED_EXP_PLUGINS names the module 'no_such_module', which cannot be imported" in proc.stderr


@pytest.mark.slow
def test_15_a_second_signal_kills_and_says_so_and_names_the_checkpoint(tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    proc = start_job([*LONG, "trainer.checkpoint_every=5", "trainer.stop_grace_s=30", f"hydra.run.dir={run}"], log,
                     env={"SHARDED_EXP_FAULT": "rank=1,step=8,kind=hang"})  # fmt: skip
    wait_until(lambda: "SHARDED_EXP_FAULT: hang" in log.read_text(), proc, log)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc, log)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    result = read_result(run)
    assert "ranks were killed (at a second signal, SIGTERM)" in result["error"]
    assert "after step None" not in output and "stopped by signal 15: " in output
    assert result["checkpoint"] == str(run / "checkpoints" / "step_00000005")


def test_15_report_of_an_empty_directory_writes_nothing(tmp_path):
    proc = run_cli([str(tmp_path)], cwd=ROOT, module="sharded_exp.report")
    assert proc.returncode == 1 and "no result.json" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_15_schemas_are_not_listed_as_options(tmp_path):
    proc = run_cli(["precision=8", f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode != 0 and "Available options in 'precision'" in proc.stderr
    assert "_schema" not in proc.stderr and "bf16" in proc.stderr


def test_15_readme_places_per_rank_under_memory():
    readme = (ROOT / "README.md").read_text()
    assert "`memory.per_rank`" in readme
    assert "result.json`: `per_rank`" not in readme and "top-level `per_rank`" not in readme


@pytest.mark.slow
def test_a_long_history_does_not_deadlock_the_parent(tmp_path):
    """Found on this pass: rank 0's payload (the history, with every rank's memory per
    interval) larger than a pipe's buffer blocked rank 0 in put() while the parent waited
    for it to exit; the parent now reads the payload while it waits."""
    result = run_job(["trainer.steps=1200", "trainer.log_interval=1"], tmp_path)
    assert result["status"] == "ok" and len(result["history"]) == 1200
    assert len(json.dumps(result["history"])) > 2**16  # more than a pipe holds


# ================================================== issue 22: the second hostile pass
# ----------------------------------------- 1 and 8: a rank that exits 0 without a result
@pytest.mark.parametrize(
    "how, ranks, blamed",
    [("os", "[0,1]", None), ("sys", "[0,1]", None), ("os", "[1]", 1)],  # None: either rank (both did it)
    ids=["every-rank-os-exit-0", "every-rank-sys-exit-0", "one-rank-os-exit-0"],
)
def test_22_1_a_rank_that_exits_0_without_a_result_is_the_named_failure(how, ranks, blamed, tmp_path):
    t0 = time.monotonic()
    overrides = ["model=custom", "model._target_=tests.user_models.build_exits", f"+model.how={how}",
                 f"+model.ranks={ranks}", "trainer.timeout_s=60"]  # fmt: skip
    result = launch(overrides, tmp_path)
    assert time.monotonic() - t0 < 40, "the parent waited for a result that never came"
    assert result["status"] == "failed"
    assert result["error"].startswith(f"rank {blamed}:" if blamed is not None else "rank "), result["error"]
    assert "exit" in result["error"] and "Connection" not in result["error"], result["error"]
    assert read_result(tmp_path)["status"] == "failed"
    assert not (tmp_path / ".lock").exists()


# ------------------------------------ 2. checkpoints of another trajectory, shared directories
def test_22_2_later_checkpoints_of_another_trajectory_are_refused_or_archived(tmp_path):
    first = tmp_path / "first"
    ckpts = tmp_path / "ckpts"
    args = ["trainer.steps=4", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={ckpts}"]
    assert launch(args, first)["status"] == "ok"
    old_four = (ckpts / "step_00000004" / "meta.json").read_bytes()
    resume = [*args, f"trainer.resume={ckpts / 'step_00000002'}", "optimizer.lr=0.01"]
    # Refused before anything is written: the later step is named, and the ways out.
    with pytest.raises(ConfigError, match=r"already holds step_00000004.*trainer.existing_checkpoints=archive"):
        launch(resume, tmp_path / "second")
    assert not (tmp_path / "second").exists()
    # A fresh run into the same directory would meet steps 2 and 4: refused as well.
    with pytest.raises(ConfigError, match="step_00000002, step_00000004"):
        launch(args, tmp_path / "third")
    # Archived on request: the new step 4 is this trajectory's, and result.json names it.
    result = launch([*resume, "trainer.existing_checkpoints=archive"], tmp_path / "second")
    assert result["status"] == "ok", result["error"]
    assert result["checkpoint"] == str(ckpts / "step_00000004")
    assert (ckpts / "archived" / "1" / "step_00000004" / "meta.json").read_bytes() == old_four
    assert (ckpts / "step_00000004" / "meta.json").read_bytes() != old_four
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpts))] == [2, 4]


def test_22_2_a_checkpoint_directory_is_held_by_one_job(tmp_path):
    from sharded_exp.checkpoint.storage import hold_checkpoint_dir
    from sharded_exp.launch.parent import release_run_dir

    ckpts = tmp_path / "ckpts"
    held = hold_checkpoint_dir(str(ckpts))  # as a live job holds it
    try:
        with pytest.raises(ConfigError, match=r"trainer.checkpoint_dir=.*ckpts is in use by a running job \(pid"):
            launch(["trainer.steps=2", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={ckpts}"], tmp_path / "b")
        assert not (tmp_path / "b" / "result.json").exists()
    finally:
        release_run_dir(held)
    # A file, or a directory that cannot be written: said before any rank starts.
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        launch(["trainer.resume=auto", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={tmp_path / 'file'}"],
               tmp_path / "c")  # fmt: skip


# ------------------------------------------------------------- 5. a 0-dim parameter
SCALAR = ["model=custom", "model._target_=tests.user_models.build_with_scalar", "trainer.grad_accum=2",
          "trainer.save_final_state=true", "optimizer.lr=1e-2", "trainer.steps=4"]  # fmt: skip


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=[] if s == "fsdp" else pytest.mark.slow) for s in STRATEGY_NAMES if s != "ddp"]
)
def test_22_5_a_0_dim_parameter_trains_under_every_strategy_as_under_ddp(strategy, shared_runs):
    from tests.helpers.states import max_relative_diff

    ref_dir, ref = shared_runs("strategy=ddp", *SCALAR)
    out, result = shared_runs(f"strategy={strategy}", *SCALAR)
    assert ref["status"] == "ok" and result["status"] == "ok", result["error"]
    final = torch.load(out / "model_final.pt", weights_only=True)
    assert final["temperature"].dim() == 0 and final["temperature"].item() != 1.0  # trained, still a scalar
    assert max_relative_diff(out, ref_dir) <= 1e-6
    assert result["memory"]["predicted_peak_mib_max"] is not None


def test_22_5_the_planner_takes_a_0_dim_parameter():
    proc = run_cli(["model=custom", "model._target_=tests.user_models.build_with_scalar", "plan.world_sizes=[2]",
                    "plan.strategies=[fsdp,fsdp_grad_op]"], cwd=ROOT, module="sharded_exp.plan")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp_grad_op" in proc.stdout and "IndexError" not in proc.stderr


# ------------------------------------------------------- 6. an error line, not a traceback
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=custom", "model._target_=tests.user_models.build_none"],
         "model._target_=tests.user_models.build_none returned None (does it return the model?), not a torch.nn.Module"),
        (["model=custom", "model._target_=tests.user_models.build_not_a_module"], "returned a dict, not a torch.nn.Module"),
        (["model=custom"], "model._target_ must be set: no value was given (model=custom needs model._target_="),
        (["trainer.checkpoint_dir=${oc.env:SHARDED_EXP_SURELY_UNSET}"],
         "error: trainer.checkpoint_dir: KeyError raised while resolving interpolation: \"Environment variable "
         "'SHARDED_EXP_SURELY_UNSET' not found\""),
    ],
    ids=["factory-returns-none", "factory-returns-a-dict", "custom-without-target", "unset-env-interpolation"],
)  # fmt: skip
def test_22_6_bad_models_and_values_get_an_error_line(overrides, message, tmp_path):
    proc = cli(tiny(overrides), tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.fixture
def read_only_copy(tmp_path):
    """A read-only filesystem (tmpfs remounted ro) holding a copy of what ``fill`` puts there."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")

    def freeze(fill):
        fill(mount)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        return mount

    yield freeze
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_22_6_read_only_destinations_and_w_and_b_without_a_key_get_an_error_line(tmp_path, read_only_copy):
    run = tmp_path / "run"
    assert cli([*TINY, "trainer.steps=2", "strategy=fsdp", "trainer.checkpoint_every=2", "logger=wandb"],
               run).returncode == 0  # fmt: skip
    ro = read_only_copy(lambda m: shutil.copytree(run, m / "sweep" / "0_point"))
    # the report of a sweep directory that cannot be written
    proc = run_cli([str(ro / "sweep")], cwd=ROOT, module="sharded_exp.report")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: report not written in {ro / 'sweep'}: Read-only file system" in proc.stderr
    # a checkpoint exported to a read-only destination
    proc = run_cli(["export", str(run / "checkpoints" / "step_00000002"), str(ro / "exported")], cwd=ROOT,
                   module="sharded_exp.checkpoint")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: cannot export to {ro / 'exported'}: Read-only file system" in proc.stderr
    # the W&B workspace saved online without an API key
    sweep = tmp_path / "sweep"
    shutil.copytree(run, sweep / "0_point")
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path / "home"), "WANDB_CONFIG_DIR": str(tmp_path / "wb")}
    proc = run_cli([str(sweep), "--wandb-workspace", "--online"], cwd=ROOT, env=env, module="sharded_exp.report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: W&B: No API key configured" in proc.stderr


# ---------------------------------------- 7. unused parameters; strategy keys nobody reads
def test_22_7_find_unused_parameters_is_a_setting_and_unknown_strategy_keys_are_refused(tmp_path):
    unused = ["model=custom", "model._target_=tests.user_models.build_with_unused", "trainer.steps=3"]
    failed = launch(unused, tmp_path / "without")
    assert failed["status"] == "failed" and "find_unused_parameters" in failed["error"]
    result = launch([*unused, "strategy.find_unused_parameters=true"], tmp_path / "with")
    assert result["status"] == "ok", result["error"]
    assert result["config"]["strategy"]["find_unused_parameters"] is True
    assert result["memory"]["predicted_peak_mib_max"] is not None, result["memory"]["peak_prediction"]
    with pytest.raises(ConfigError, match=r"strategy.find_unused=true|strategy.find_unused is not a setting of "
                                          r"strategy=zero1; its settings: .*find_unused_parameters"):  # fmt: skip
        launch(["strategy=zero1", "+strategy.find_unused=true"], tmp_path / "typo")
    assert not (tmp_path / "typo").exists()


# --------------------------------------------------------- 12. host memory on CPU
def test_22_12_a_cpu_job_predicted_beyond_host_memory_is_refused_before_spawn(tmp_path, monkeypatch):
    from sharded_exp.launch import preflight

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    assert 0 < preflight.available_host_mib() <= total  # read from /proc/meminfo (or the cgroup)
    monkeypatch.setattr(preflight, "available_host_mib", lambda: 500.0)  # a small machine
    with pytest.raises(ConfigError, match=r"the job needs about [\d,]+ MiB of host memory \(2 rank\(s\).*"
                                          r"500 MiB are available here.*trainer.host_memory_check=false"):  # fmt: skip
        launch(["trainer.accelerator=cpu", "trainer.steps=2"], tmp_path / "run")
    assert not (tmp_path / "run").exists()
    result = launch(["trainer.accelerator=cpu", "trainer.steps=2", "trainer.host_memory_check=false"], tmp_path / "run")
    assert result["status"] == "ok"


# ------------------------------------------- 13. a composition error leaves no directory
@pytest.mark.parametrize("bad", ["strategy=zero3", "trainer.stepz=3"])
def test_22_13_a_composition_error_leaves_no_run_directory(bad, tmp_path):
    proc = run_cli([bad, f"hydra.run.dir={tmp_path / 'new' / 'run'}"], cwd=ROOT)
    # exit 2, as every other mistake on the command line (an out-of-range value below)
    assert proc.returncode == 2 and ("zero3" in proc.stderr or "stepz" in proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "new").exists()
    proc = run_cli(["trainer.steps=5", "logger=none"], cwd=tmp_path)  # warm-up 5 of 5 steps: refused
    assert proc.returncode == 2 and "trainer.warmup_steps=5 must be" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), "a refused config leaves no outputs/runs/ behind"
    (tmp_path / "afile").write_text("x")
    proc = run_cli(["trainer.steps=2", f"hydra.run.dir={tmp_path / 'afile' / 'run'}"], cwd=ROOT)
    assert proc.returncode == 2 and "afile is a file, not a directory" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------- 14. negative evaluation settings
@pytest.mark.parametrize(
    "bad, message",
    [("trainer.eval_every=-1", "trainer.eval_every=-1 must be >= 0 (0 = only at the end)"),
     ("trainer.eval_batches=-2", "trainer.eval_batches=-2 must be >= 0 (0 = no evaluation)")],
)  # fmt: skip
def test_22_14_negative_evaluation_settings_are_refused(bad, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        launch([bad], tmp_path / "run")


# ------------------------------------------------------------- 17 and 18
def test_22_17_a_model_beside_plan_params_is_refused():
    proc = run_cli(["model=gpt2_small", "plan.params=1e9"], cwd=ROOT, module="sharded_exp.plan")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "plan.params=1e+09 plans a raw parameter count, and model=gpt2_small would be ignored" in proc.stderr


def test_22_18_a_float64_model_is_measured_and_predicted_in_its_own_dtype(tmp_path):
    from sharded_exp.predict.fake_step import _short

    result = launch(["model=custom", "model._target_=tests.user_models.build_double", "trainer.steps=3"], tmp_path)
    memory = result["memory"]
    assert result["status"] == "ok" and memory["peak_prediction"]["error"] is None
    assert memory["predicted_model_states_mib_max"] == pytest.approx(memory["model_states_mib_max"], rel=1e-6)
    assert memory["predicted_peak_mib_max"] == pytest.approx(memory["peak_allocated_mib_max"], rel=0.1)
    # a wrapped error's second line (what went wrong) is kept
    assert _short(RuntimeError("Error in call to target 'x':\nValueError('the cause')")).endswith("the cause')")


# ------------------------------------------------------ 19. BatchNorm buffers under FSDP
BN = ["model=custom", "model._target_=tests.user_models.build_with_batchnorm", "trainer.steps=4",
      "trainer.save_final_state=true", "trainer.eval_batches=4"]  # fmt: skip


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("fsdp_grad_op", marks=pytest.mark.slow)])
def test_22_19_buffers_agree_across_ranks_and_with_ddp(strategy, shared_runs):
    from tests.helpers.states import max_relative_diff

    ref_dir, ref = shared_runs("strategy=ddp", *BN)
    out, result = shared_runs(f"strategy={strategy}", *BN)
    assert result["status"] == "ok", result["error"]
    # Each rank's running statistics are DDP's: rank 0's, broadcast before every forward.
    for mine, ddp in zip(result["memory"]["per_rank"], ref["memory"]["per_rank"]):
        assert mine["buffer_digest"] == pytest.approx(ddp["buffer_digest"], rel=1e-6), (mine["rank"], ref["memory"])
    assert result["eval"]["final"]["eval/accuracy"] == ref["eval"]["final"]["eval/accuracy"]
    assert result["eval"]["final"]["eval/loss"] == pytest.approx(ref["eval"]["final"]["eval/loss"], rel=1e-5)
    assert max_relative_diff(out, ref_dir) <= 1e-6  # model_final.pt: parameters and buffers


# ------------------------------------------------------------- 20. cosmetics
def test_22_20_a_resumed_bar_ends_full_and_the_output_directory_is_printed(tmp_path):
    args = [*TINY, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.progress_bar=true"]
    first = cli([*args, "trainer.steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    proc = cli([*args, "trainer.resume=auto"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bar = proc.stderr.split("\r")[-1]
    assert "100%" in bar and "4/4" in bar, bar  # from step 2 to 4: full, not 50%
    assert f"output: {tmp_path}" in proc.stdout


# ------------------------------------------------- issue 23.14 and 23.12 (CUDA side: benchmarks/gpu_check.py)
def test_23_14_result_json_names_the_device_that_ran_the_job(shared_runs):
    _, result = shared_runs("strategy=ddp", *SCALAR)
    device = result["device"]
    assert device["type"] == "cpu" and device["count"] == os.cpu_count() and device["threads_per_rank"] >= 1


def test_23_12_cuda_window_resets_the_accumulated_counters(monkeypatch):
    from sharded_exp.measure.tracker import MemoryMeter

    calls = []
    for name in ("synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: calls.append(_n))
    MemoryMeter(torch.device("cuda", 0), None).start()
    assert calls == ["synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"]


def test_22_18_a_meta_built_fake_model_keeps_its_tied_weights_tied():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sharded_exp.train.build import _tied_to_empty
    from tests.user_models import build_tied_double

    with torch.device("meta"):
        module = build_tied_double(8, 3)
    with FakeTensorMode(allow_non_fake_inputs=True):  # as the fake step's mode
        module = _tied_to_empty(module, torch.device("cpu"))
    assert module.extra.weight is module.layers[1].weight and module.extra.weight.dtype == torch.float64
    assert len(list(module.named_parameters(remove_duplicate=False))) == 8 and len(list(module.parameters())) == 7


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_grad_op"])
def test_22_19_batchnorm_trains_under_fsdp_at_bf16_like_ddp(strategy, shared_runs):
    """FSDP's half-precision policy cast BatchNorm's weight beside its fp32 statistics, and
    a CPU run failed ("expected scalar type BFloat16 but found Float"): BatchNorm is now a
    unit of its own in fp32, as autocast runs it under DDP."""
    args = [*BN, "precision=bf16", "trainer.world_size=3", "trainer.grad_accum=2", "trainer.freeze=[layers.0.*]"]
    _, ref = shared_runs("strategy=ddp", *args)
    _, result = shared_runs(f"strategy={strategy}", *args)
    assert ref["status"] == "ok" and result["status"] == "ok", result["error"]
    assert result["final_loss"] == pytest.approx(ref["final_loss"], rel=2e-2)  # bf16 rounding


# ----------------------------------------------- issue 23.6: what memory_limit_mib bounds
def test_23_6_the_memory_limit_says_what_it_bounds_and_caps_cuda_before_the_build(tmp_path, monkeypatch, capsys):
    from sharded_exp.measure.tracker import MemoryMeter
    from sharded_exp.models import build_model

    result = launch(["trainer.memory_limit_mib=1000", "trainer.steps=2"], tmp_path / "cpu")
    assert result["memory"]["memory_limit_applies_to"].startswith("live tensors the CPU memory tracker counts")
    free = launch(["trainer.steps=2"], tmp_path / "none")
    assert free["memory"]["memory_limit_applies_to"] is None
    # A budget between the model states and the step's peak: crossed inside a step.
    mem = free["memory"]
    limit = (mem["model_states_mib_max"] + mem["peak_allocated_mib_max"]) / 2
    capsys.readouterr()
    oom = launch([f"trainer.memory_limit_mib={limit}", "trainer.steps=2"], tmp_path / "oom")  # over it: said there too
    assert oom["status"] == "oom" and oom["memory"]["memory_limit_applies_to"].startswith("live tensors")
    # Issue 25: what was live when the budget was first exceeded, on the rank that failed first.
    b = oom["memory"]["oom_breakdown"]
    assert b is not None and oom["memory"]["oom_breakdown_error"] is None, oom["memory"]
    assert b["step"] in (0, 1) and b["phase"] in ("forward", "backward", "optimizer", "other")
    assert limit < b["tracked_mib"] <= mem["peak_allocated_mib_max"] + 1e-9
    assert sum(b["by_category_mib"].values()) == pytest.approx(b["tracked_mib"])
    # Every live byte is filed under one module (or none): the attribution adds up.
    filed = sum(b["top_modules_mib"].values()) + b["other_modules_mib"] + b["outside_modules_mib"]
    assert filed == pytest.approx(b["tracked_mib"])
    states = free["memory"]["per_rank"][b["rank"]]["model_states_mib"]
    assert b["by_category_mib"]["Parameter"] == pytest.approx(states["params"])  # the same model, measured apart
    names = {n for n, _ in build_model(compose_cfg(tiny([])).model).named_modules()}
    assert b["top_modules_mib"] and set(b["top_modules_mib"]) <= names, b["top_modules_mib"]
    assert b["rank"] in {f["rank"] for f in _rank_errors(tmp_path / "oom") if f["memory_at_oom"]}
    printed = capsys.readouterr().out
    assert f"out of memory on rank {b['rank']} at step {b['step']} ({b['phase']})" in printed
    assert next(iter(b["top_modules_mib"])) in printed
    # ... and the report's row for the point says it in one cell.
    from sharded_exp.output.comparison import _row

    cell = _row(oom)["oom_breakdown"]
    assert cell.startswith(f"rank {b['rank']} step {b['step']} ({b['phase']}): {b['tracked_mib']:.2f} MiB over {limit}")
    assert next(iter(b["top_modules_mib"])) in cell and "Parameter" in cell
    # On CUDA the cap is set when the meter is made, before the model and optimizer are built.
    capped = []
    props = type("Props", (), {"total_memory": 80 * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    meter = MemoryMeter(torch.device("cuda", 0), 8 * 1024)
    assert capped == [(0.1, torch.device("cuda", 0))] and meter.LIMIT_APPLIES_TO["cuda"].startswith("reserved bytes")
