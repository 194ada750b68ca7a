"""sharded_exp.report.command in-process: the command's arguments and exit codes, and the multirun
callback (the sweep id and lock at the start, the report and the count of failed points at
the end). Charts are not drawn here (matplotlib's import alone is over a second)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import sharded_exp.sweep
from sharded_exp.report import command, publish
from sharded_exp.report.rows import build_rows
from sharded_exp.report.sweep_points import SWEEP_ID
from sharded_exp.report.text import headline
from tests.helpers.unit_output import point, write_point


@pytest.fixture
def no_charts(monkeypatch):
    monkeypatch.setattr(publish, "write_charts", lambda rows, where: [])


@pytest.fixture
def callback(monkeypatch):
    monkeypatch.setattr(command.ReportCallback, "failed_points", 0)  # a class-wide count: reset per test
    return command.ReportCallback()


def sweep_config(sweep_dir):
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})


# ------------------------------------------------------------------------ the command
def test_the_arguments():
    args = command.parse(["out/sw"])
    assert args.sweep_dir == Path("out/sw") and not args.wandb_workspace and not args.online and args.entity is None
    args = command.parse(["out/sw", "--wandb-workspace", "--online", "--entity", "me"])
    assert args.wandb_workspace and args.online and args.entity == "me"


def test_a_missing_directory_is_a_usage_error(tmp_path, capsys):
    assert command.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m sharded_exp.report SWEEP_DIR")


def test_a_directory_without_results_is_an_error(tmp_path, capsys):
    assert command.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: no result.json of the sweep that last ran under {tmp_path}\n"
    assert not (tmp_path / "report.md").exists()


def test_a_directory_holding_only_an_earlier_sweeps_points_says_so(tmp_path, capsys):
    """A refused or aborted sweep wrote a new sweep id and ran nothing: the points there are
    an earlier sweep's, named as left out, not "no result.json"."""
    write_point(tmp_path, "0_strategy=ddp", point("ddp", n=0) | {"sweep_id": "old"})
    (tmp_path / SWEEP_ID).write_text("new\n")
    assert command.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("report: 1 stale point(s) of an earlier sweep left out (")
    assert f"this sweep's id is in {tmp_path / SWEEP_ID}" in err
    assert err.endswith(f"error: no result.json of the sweep that last ran under {tmp_path}\n")


def test_the_command_prints_the_headline_and_the_compact_table(tmp_path, capsys, no_charts):
    write_point(tmp_path, "0_strategy=ddp", point("ddp", n=0, peak=4.0, sps=10.0))
    write_point(tmp_path, "1_strategy=fsdp", point("fsdp", n=1, peak=2.0, sps=10.0))
    assert command.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("At 2 ranks, fsdp peaks 50% below ddp (2.00 vs 4.00 MiB) at 1.00x")
    assert "\n| strategy | world_size | precision |" in out
    assert out.endswith(f"report: {tmp_path / 'report.md'} (every column, the charts)\n")
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.csv").exists()


def test_a_report_that_cannot_be_written_fails_the_command(tmp_path, capsys, monkeypatch):
    def full(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "write_report", full)
    assert command.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: report not written in {tmp_path}: No space left on device\n"


def test_a_workspace_for_a_sweep_without_wandb_is_refused(tmp_path, capsys, no_charts):
    write_point(tmp_path, "0_strategy=ddp", point("ddp", peak=1.0))
    assert command.main([str(tmp_path), "--wandb-workspace"]) == 2
    assert "did not log to W&B (logger=wandb); no workspace to build" in capsys.readouterr().err


# ------------------------------------------------------------------------ the multirun callback
def test_the_end_of_a_sweep_counts_the_points_that_failed(callback, monkeypatch, tmp_path, capsys):
    statuses = ["ok", "oom", "stopped", "failed", "diverged", "unreadable"]
    rows = build_rows([point("ddp", n=n, status=s, peak=1.0, sps=10.0) for n, s in enumerate(statuses)])
    monkeypatch.setattr(publish, "write_report", lambda d: rows)
    callback._report(tmp_path)
    assert command.ReportCallback.failed_points == 3  # failed, diverged, unreadable: not ok, oom or stopped
    out, err = capsys.readouterr()
    assert out == f"{command.wrapped(headline(rows))}\nreport: {tmp_path / 'report.md'} (6 points)\n"
    assert out.startswith("At 2 ranks, only ddp fits (1.00 MiB). ddp runs out of memory at 2 ranks;")
    assert err == "error: 3 sweep point(s) failed or diverged (their status in the report)\n"


def test_a_sweep_whose_points_all_finished_fails_nothing(callback, monkeypatch, tmp_path, capsys):
    rows = build_rows([point("ddp", status="ok", peak=2.0), point("fsdp", n=1, status="oom")])
    monkeypatch.setattr(publish, "write_report", lambda d: rows)
    callback._report(tmp_path)
    assert command.ReportCallback.failed_points == 0 and capsys.readouterr().err == ""


def test_a_sweep_without_results_or_whose_report_fails(callback, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(publish, "write_report", lambda d: [])
    callback._report(tmp_path)
    assert command.ReportCallback.failed_points == 0
    assert capsys.readouterr().err == f"report: no result.json of this sweep under {tmp_path}; no report written\n"

    def denied(_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(publish, "write_report", denied)
    callback._report(tmp_path)
    assert command.ReportCallback.failed_points == 1  # a report not written fails the sweep
    assert capsys.readouterr().err == f"error: report not written in {tmp_path}: Permission denied\n"


def test_a_sweep_holds_its_directory_with_a_new_id_until_its_report(callback, monkeypatch, tmp_path):
    """Each sweep its own id; the points are composed first only in a directory an earlier
    sweep left (a refusal by Hydra would overwrite its record there)."""
    reused = []
    monkeypatch.setattr(sharded_exp.sweep, "check_multirun", lambda config, again: reused.append(again))
    monkeypatch.setattr(publish, "write_report", lambda d: build_rows([point("ddp", peak=1.0)]))
    sweep_dir = tmp_path / "sweep"
    callback.on_multirun_start(sweep_config(sweep_dir))
    first = (sweep_dir / SWEEP_ID).read_text()
    assert re.fullmatch(r"[0-9a-f]{32}\n", first)
    assert callback.lock is not None and (sweep_dir / ".lock").exists()
    callback.on_multirun_end(sweep_config(sweep_dir))
    assert callback.lock is None and not (sweep_dir / ".lock").exists()
    callback.on_multirun_start(sweep_config(sweep_dir))
    assert (sweep_dir / SWEEP_ID).read_text() != first  # each sweep its own id
    callback.on_multirun_end(sweep_config(sweep_dir))
    assert reused == [False, True]


def test_the_lock_is_released_even_when_the_report_raises(callback, monkeypatch, tmp_path):
    lock = open(tmp_path / ".lock", "w")
    callback.lock = lock

    def broken(_):
        raise RuntimeError("bug")

    monkeypatch.setattr(callback, "_report", broken)
    with pytest.raises(RuntimeError):
        callback.on_multirun_end(sweep_config(tmp_path))
    assert lock.closed and callback.lock is None and not (tmp_path / ".lock").exists()
