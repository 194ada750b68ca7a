"""__main__.py's entry point: an interrupt outside the job's own handling is one line and
exit 130, not a traceback; what an OSError left is said; a finished job's result is read back."""

from __future__ import annotations

import pytest

from sharded_exp import __main__ as job


def test_ctrl_c_after_the_job_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "main", interrupted)
    monkeypatch.setattr(job.signal, "signal", lambda *a: None)  # this test process keeps its own handlers
    monkeypatch.setattr(job, "exit_now", lambda code: job.sys.exit(code))  # not os._exit: this is pytest
    monkeypatch.setattr(job.logging, "shutdown", lambda: None)  # nor pytest's own log handlers closed
    monkeypatch.setattr(job.sys, "argv", ["sharded_exp", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as ended:
        job.run()
    assert ended.value.code == 130
    err = capsys.readouterr().err
    assert err == "error: stopped (SIGINT); what the job had written is kept\n"


def test_sigterm_before_the_ranks_start_is_one_line_and_leaves_no_run_directory(monkeypatch, capsys, tmp_path):
    """SIGTERM or SIGHUP while the job's own stop handling is not in place (the parent still
    checking): said like Ctrl-C, exit 143, and the run directory Hydra made for nothing (its
    lock alone) goes; a directory holding what a job wrote stays."""
    installed = {}
    run_dir = tmp_path / "run"

    def stopped_while_checking():
        run_dir.mkdir()
        (run_dir / ".lock").write_text("1\n")
        monkeypatch.setattr(job, "RUN_DIR", str(run_dir))
        installed[job.signal.SIGTERM](job.signal.SIGTERM, None)  # the signal arriving

    monkeypatch.setattr(job, "main", stopped_while_checking)
    monkeypatch.setattr(job.signal, "signal", lambda sig, handler: installed.__setitem__(sig, handler))
    monkeypatch.setattr(job, "exit_now", lambda code: job.sys.exit(code))  # not os._exit: this is pytest
    monkeypatch.setattr(job.logging, "shutdown", lambda: None)  # nor pytest's own log handlers closed
    monkeypatch.setattr(job.sys, "argv", ["sharded_exp", f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as ended:
        job.run()
    assert ended.value.code == 143 and set(installed) == {job.signal.SIGTERM, job.signal.SIGHUP}
    assert capsys.readouterr().err == "error: stopped (SIGTERM); what the job had written is kept\n"
    assert not run_dir.exists()


def test_an_os_error_after_the_ranks_started_does_not_say_the_job_did_not_run(tmp_path):
    import json

    assert job.what_ran(str(tmp_path / "nothing_here")) == "the job did not run"
    (tmp_path / "result.json").write_text(json.dumps({"status": "running"}))
    assert job.what_ran(str(tmp_path)) == (
        f"the job ran, but its result could not be written ({tmp_path}/result.json still says running)"
    )
    (tmp_path / "result.json").write_text(json.dumps({"status": "ok"}))
    assert job.what_ran(str(tmp_path)) == "after the job ended (its result.json says ok)"


def test_a_finished_jobs_result_is_read_back_as_its_model_or_none(tmp_path):
    """A requeued job that had finished returns the result.json it left (job.result.read_result)."""
    from sharded_exp.job.result import Result, write_result

    assert job.read_result_in(str(tmp_path)) is None  # nothing there
    (tmp_path / "result.json").write_text("{not json")
    assert job.read_result_in(str(tmp_path)) is None
    fields = {"status": "ok", "strategy": "ddp", "precision": "32", "model": "mlp", "optimizer": "adam",
              "output_dir": str(tmp_path), "config": {}, "final_loss": 0.5}  # fmt: skip
    write_result(str(tmp_path), Result.of(fields))
    back = job.read_result_in(str(tmp_path))
    assert (back.status, back.final_loss) == ("ok", 0.5)
