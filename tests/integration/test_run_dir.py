"""The run directory: held by one job at a time, attempts numbered, a full or read-only
disk and a path that is a file said in one line, and nothing left behind by a job that
was refused."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.helpers.disks import fill
from tests.helpers.jobs import ROOT, TINY, launch_job, run_cli
from tests.helpers.processes import LONG, finish, start_job, wait_until


@pytest.mark.slow
def test_a_second_job_in_a_live_run_directory_is_refused(tmp_path):
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
        finish(proc, log, timeout=60)


def test_a_gap_in_attempts_takes_the_next_free_number(tmp_path):
    launch_job(["trainer.steps=2"], tmp_path)
    (tmp_path / "attempts" / "2").mkdir(parents=True)  # 1 was deleted by hand
    result = launch_job(["trainer.steps=2"], tmp_path)
    assert result["status"] == "ok"
    assert (tmp_path / "attempts" / "3" / "result.json").exists()


@pytest.mark.slow
def test_a_run_directory_on_a_full_disk_is_an_error_line(small_fs, tmp_path):
    fill(small_fs, 0)
    run = small_fs / "run"
    proc = run_cli([*TINY, f"hydra.run.dir={run}"], cwd=ROOT)
    assert proc.returncode in (1, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "no space left on device" in proc.stderr.lower(), proc.stderr[-2000:]
    leftovers = [p.name for p in run.rglob("*") if ".tmp" in p.name] if run.exists() else []
    assert leftovers == []


@pytest.mark.slow
def test_a_run_directory_that_is_a_file_or_read_only_is_refused(tmp_path, small_fs):
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = run_cli([*TINY, f"hydra.run.dir={afile}"], cwd=ROOT)
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stderr and "Traceback" not in proc.stderr
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=60)
    proc = run_cli([*TINY, f"hydra.run.dir={small_fs / 'run'}"], cwd=ROOT)
    assert proc.returncode == 2 and "cannot be written (Read-only file system)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("bad", ["strategy=zero3", "trainer.stepz=3"])
def test_a_composition_error_leaves_no_run_directory(bad, tmp_path):
    proc = run_cli([bad, f"hydra.run.dir={tmp_path / 'new' / 'run'}"], cwd=ROOT)
    # exit 2, as every other mistake on the command line (an out-of-range value: the next test)
    assert proc.returncode == 2 and ("zero3" in proc.stderr or "stepz" in proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # the default tier's: test_rank_server.py (a ConfigError from the forked check), test_cli.py
def test_a_config_the_pre_flight_check_refuses_is_said_alone_and_leaves_no_run_directory(tmp_path):
    # The check runs in a process forked from the rank server (sharded_exp/launch/server_check.py):
    # its ConfigError reaches the parent as one line, as when it ran there
    proc = run_cli(["trainer.freeze=[*]", "logger=none"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: trainer.freeze=['*'] freezes every parameter of model=mlp"), proc.stderr
    assert "Traceback" not in proc.stderr and "rank server" not in proc.stderr
    assert not (tmp_path / "outputs").exists(), "a refused config leaves no outputs/runs/ behind"


@pytest.mark.slow
def test_a_config_that_reads_hydras_settings_is_checked_as_the_parent_reads_them(tmp_path):
    # ${hydra:run.dir} is ${paths.output_dir}/runs/${now:...}: the pre-flight check, in a process of
    # its own, must see the directory the parent made, not resolve another time or fail to resolve
    proc = run_cli(
        [
            "trainer.checkpoint_dir=${hydra:run.dir}/ckpt",
            "trainer.checkpoint_every=2",
            "trainer.steps=3",
            "trainer.warmup_steps=1",
            "logger=none",
        ],  # fmt: skip
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_00000002",
        "step_00000003",
    ]


@pytest.mark.slow  # the default tier's: test_a_composition_error_leaves_no_run_directory
def test_a_refused_config_or_a_run_directory_under_a_file_leaves_nothing(tmp_path):
    proc = run_cli(["trainer.steps=5", "logger=none"], cwd=tmp_path)  # warm-up 5 of 5 steps: refused
    assert proc.returncode == 2 and "trainer.warmup_steps=5 must be" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), "a refused config leaves no outputs/runs/ behind"
    (tmp_path / "afile").write_text("x")
    proc = run_cli(
        ["trainer.steps=2", "trainer.warmup_steps=1", f"hydra.run.dir={tmp_path / 'afile' / 'run'}"], cwd=ROOT
    )
    assert proc.returncode == 2 and "afile is a file, not a directory" in proc.stderr, proc.stderr[-2000:]
