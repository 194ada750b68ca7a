"""Without fairscale installed: the native strategies run, the fairscale ones are refused
before any rank starts, with an error naming the missing package.

fairscale is made unimportable in every process of the job, as if it had been
uninstalled (``conftest.without_package``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.jobs import ROOT, TINY, read_result, run_cli, without_package


@pytest.mark.slow
def test_zero1_runs_and_oss_is_refused_without_fairscale(tmp_path):
    env = without_package(tmp_path, "fairscale")
    blocked = subprocess.run(
        [sys.executable, "-c", "import fairscale"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert blocked.returncode != 0 and "No module named 'fairscale'" in blocked.stderr  # as if uninstalled
    proc = run_cli(["strategy=zero1", *TINY, f"hydra.run.dir={tmp_path / 'zero1'}"], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_result(tmp_path / "zero1")["status"] == "ok"
    assert "fairscale" not in proc.stderr

    # refused on the command line, from the cached schemas: torch is never imported (-X importtime)
    proc = run_cli(["strategy=oss", *TINY, f"hydra.run.dir={tmp_path / 'oss'}"], cwd=ROOT,
                   env={**env, "PYTHONPROFILEIMPORTTIME": "1"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "strategy=oss needs the package(s) fairscale, which are not installed here" in proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported
    assert not (tmp_path / "oss" / "result.json").exists()  # refused before any rank started
