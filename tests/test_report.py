"""A real multirun in a subprocess, then the comparison report built from its result.json files."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from tests.conftest import ROOT, TINY, run_cli


def test_sweep_report_from_result_files(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "strategy=ddp,fsdp", *TINY, f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = {json.loads(p.read_text())["strategy"]: json.loads(p.read_text()) for p in sweep.rglob("result.json")}
    assert set(points) == {"ddp", "fsdp"}

    report = subprocess.run(
        [sys.executable, "-m", "sharded_exp.report", str(sweep)], capture_output=True, text=True, check=False
    )
    assert report.returncode == 0, report.stderr
    rows = {r["strategy"]: r for r in csv.DictReader(open(sweep / "report.csv"))}
    assert set(rows) == {"ddp", "fsdp"}
    ddp, fsdp = points["ddp"]["memory"], points["fsdp"]["memory"]
    expected = 100 * (1 - fsdp["model_states_mib_max"] / ddp["model_states_mib_max"])
    assert float(rows["fsdp"]["states_saving_vs_ddp_pct"]) == expected
    assert float(rows["ddp"]["states_saving_vs_ddp_pct"]) == 0.0
    speed = points["fsdp"]["throughput"]["samples_per_s"] / points["ddp"]["throughput"]["samples_per_s"]
    assert float(rows["fsdp"]["speed_vs_ddp"]) == speed
    assert "| fsdp |" in (sweep / "report.md").read_text()


def test_report_rejects_a_missing_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "usage" in proc.stderr
