"""The development walkthroughs, followed literally: each page's files are written into a copy of
the package exactly as the page shows them, and the result is run as the page says.

A walkthrough that drifts from the code (a renamed import, a part the registry no longer reads)
fails here, not in a newcomer's hands."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, read_result, run_cli, tiny

FILE_BLOCK = re.compile(r"^`(sharded_exp/[^`]+)`:\n\n```\w*\n(.*?)^```", re.M | re.S)
"""A fenced block right under a line naming the file it is (``sharded_exp/...``:)."""


def page_files(page: str) -> dict[str, str]:
    """The files a walkthrough page shows, by path in the repository."""
    text = (ROOT / "docs" / "development" / page).read_text()
    files = {path: body for path, body in FILE_BLOCK.findall(text)}
    assert files, f"{page} shows no file"
    return files


def package_with(tmp_path: Path, files: dict[str, str]) -> dict[str, str]:
    """A copy of the package with ``files`` written into it, and the environment that imports it."""
    root = tmp_path / "tree"
    shutil.copytree(ROOT / "sharded_exp", root / "sharded_exp", ignore=shutil.ignore_patterns("__pycache__"))
    for path, body in files.items():
        target = root / path
        assert not target.exists(), f"the walkthrough's {path} already exists in the package"
        target.write_text(body)
    # A fresh cache: the schemas cache is keyed by the registries' sources, kept out of the user's home.
    return {"PYTHONPATH": str(root), "XDG_CACHE_HOME": str(tmp_path / "cache")}


@pytest.mark.slow  # a doc's conformance, not a capability: two real jobs in a copied package
def test_the_add_a_strategy_walkthrough_trains_and_plans_a_new_strategy(tmp_path, ddp_reference):
    files = page_files("add-a-strategy.md")
    assert set(files) == {"sharded_exp/strategies/one_bucket.py", "sharded_exp/conf/strategy/one_bucket.yaml"}
    env = package_with(tmp_path, files)

    out = tmp_path / "run"
    proc = run_cli([*tiny(["strategy=one_bucket"]), f"hydra.run.dir={out}"], cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = read_result(out)
    assert result["status"] == "ok"
    assert result["config"]["strategy"]["name"] == "one_bucket"
    assert result["config"]["strategy"]["bucket_cap_mb"] == 1e6
    # The same arithmetic as DDP's, in one collective: the same weights, bit for bit.
    _, ddp = ddp_reference()
    assert result["param_digest"] == ddp["param_digest"]

    plan = run_cli(
        ["model.hidden=32", "model.depth=2", "plan.strategies=[ddp,one_bucket]", "plan.world_sizes=[2]",
         "plan.device=cpu", "plan.format=json"],
        cwd=tmp_path, env=env, timeout=240, module="sharded_exp.plan",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-3000:]
    rows = {row["strategy"]: row for row in json.loads(plan.stdout)["rows"]}
    assert set(rows) == {"ddp", "one_bucket"}
    # DDP's memory model, so DDP's figures.
    assert rows["one_bucket"]["total_gib"] == rows["ddp"]["total_gib"]
    assert rows["one_bucket"]["buckets_gib"] == rows["ddp"]["buckets_gib"] > 0


def test_the_walkthrough_pages_are_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in ("add-a-strategy.md",):
        assert f"development/{page}" in nav
        assert os.path.exists(ROOT / "docs" / "development" / page)
