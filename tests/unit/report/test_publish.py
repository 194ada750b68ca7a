"""sharded_exp.report.publish: the report's files written together, stale points named, and no W&B run for a sweep without W&B."""

from __future__ import annotations

import csv

from sharded_exp.report import publish
from sharded_exp.report.rows import columns
from sharded_exp.report.sweep_points import SWEEP_ID
from tests.helpers.unit_output import pair, point, write_point


def test_write_report_writes_the_tables_and_names_stale_points(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "write_charts", lambda rows, where: [])
    (tmp_path / SWEEP_ID).write_text("s1")
    write_point(tmp_path, "1_strategy=ddp", point("ddp", n=1, peak=4.0, sps=10.0, sweep_id="s1"))
    write_point(tmp_path, "2_strategy=fsdp", point("fsdp", n=2, peak=1.0, sps=5.0, sweep_id="s1"))
    write_point(tmp_path, "3_strategy=oss", point("oss", n=3, peak=1.0, sweep_id="s0"))
    (tmp_path / "memory.png").write_bytes(b"an earlier report's chart")
    rows = publish.write_report(tmp_path)
    assert [r["strategy"] for r in rows] == ["ddp", "fsdp"]
    table = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert list(table[0]) == columns(rows)
    assert [(r["strategy"], r["peak_saving_pct"]) for r in table] == [("ddp", "0.0"), ("fsdp", "75.0")]
    md = (tmp_path / "report.md").read_text()
    assert "1 point(s) left here by an earlier sweep are not in this report: point 3." in md
    assert not (tmp_path / "memory.png").exists()  # not drawn this time: report.md no longer links it
    assert not list(tmp_path.glob(".report-*"))  # the staging directory is gone


def test_write_report_of_an_empty_directory_writes_nothing(tmp_path):
    assert publish.write_report(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_without_wandb_logs_no_report_run(tmp_path):
    publish.log_to_wandb(pair(), [point("ddp")], [], tmp_path)  # logger none: returns before importing wandb
    assert list(tmp_path.iterdir()) == []
