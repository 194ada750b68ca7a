"""__main__.py's entry point: an interrupt outside the job's own handling is one line and
exit 130, not a traceback."""

from __future__ import annotations

import pytest

from sharded_exp import __main__ as job


def test_ctrl_c_after_the_job_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "main", interrupted)
    monkeypatch.setattr(job.sys, "argv", ["sharded_exp", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as ended:
        job.run()
    assert ended.value.code == 130
    err = capsys.readouterr().err
    assert err == "error: interrupted (SIGINT); what the job had written is kept\n"
