"""Without fairscale installed: the native strategies run, the fairscale ones are refused
before any rank starts, with an error naming the missing package.

fairscale is made unimportable in every process of the job (the parent, the forkserver,
the ranks) by a ``sitecustomize`` on PYTHONPATH that refuses to import it, as if it had
been uninstalled.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, TINY, read_result, run_cli

BLOCKER = """
import sys

class _NoFairscale:
    def find_spec(self, name, path=None, target=None):
        if name == "fairscale" or name.startswith("fairscale."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoFairscale())
"""


def _env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_zero1_runs_and_oss_is_refused_without_fairscale(tmp_path):
    env = _env(tmp_path)
    blocked = subprocess.run(
        [sys.executable, "-c", "import fairscale"], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert blocked.returncode != 0 and "No module named 'fairscale'" in blocked.stderr  # as if uninstalled
    proc = run_cli(["strategy=zero1", *TINY, f"hydra.run.dir={tmp_path / 'zero1'}"], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_result(tmp_path / "zero1")["status"] == "ok"
    assert "fairscale" not in proc.stderr

    proc = run_cli(["strategy=oss", *TINY, f"hydra.run.dir={tmp_path / 'oss'}"], cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "strategy=oss needs the package(s) fairscale, which are not installed here" in proc.stderr
    assert not (tmp_path / "oss" / "result.json").exists()  # refused before any rank started
