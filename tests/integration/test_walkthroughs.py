"""The development walkthroughs, followed literally: each page's files are written into a copy of
the package exactly as the page shows them, and the result is run as the page says.

A page shows two kinds of block, each a fenced block right under a line that says where it goes:

- a new file, under `` `sharded_exp/PATH`: ``, written whole;
- lines added to a table of an existing module, under
  `` `sharded_exp/PATH`, at the end of `NAME`: ``. ``NAME`` is a module-level tuple, list or
  dict written over several lines; the block's lines go just before the line of its closing
  bracket, unchanged (the indentation and trailing comma are the page's).

A walkthrough that drifts from the code (a renamed import, a part the registry no longer reads)
fails here, not in a newcomer's hands."""

from __future__ import annotations

import ast
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


EDIT_BLOCK = re.compile(r"^`(sharded_exp/[^`]+)`, at the end of `(\w+)`:\n\n```\w*\n(.*?)^```", re.M | re.S)
"""A fenced block right under a line naming an existing file and a table in it
(``sharded_exp/...``, at the end of ``NAME``:)."""


def page_edits(page: str) -> list[tuple[str, str, str]]:
    """The additions a walkthrough page makes to existing files: (path, table, lines), in page order."""
    return EDIT_BLOCK.findall((ROOT / "docs" / "development" / page).read_text())


def add_at_end_of(source: str, name: str, lines: str) -> str:
    """``source`` with ``lines`` added at the end of the module-level table ``name`` (a tuple,
    list or dict literal written over several lines): just before the line of its closing
    bracket, as a reader of the page would type them."""
    tables = [
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and name in [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
    ]  # fmt: skip
    assert len(tables) == 1, f"{name}: not one module-level assignment ({len(tables)} found)"
    table = tables[0]
    assert isinstance(table, ast.Tuple | ast.List | ast.Dict), f"{name} is not a table literal"
    old = source.splitlines(keepends=True)
    closing = table.end_lineno - 1  # index of the line holding its closing bracket
    assert table.end_lineno > table.lineno and old[closing].lstrip()[:1] in ")]}", (
        f"{name}: its closing bracket is not on a line of its own"
    )
    return "".join(old[:closing]) + lines + "".join(old[closing:])


def package_with(tmp_path: Path, files: dict[str, str], edits=()) -> dict[str, str]:
    """A copy of the package with ``files`` written into it and ``edits`` (:func:`page_edits`)
    made to it, and the environment that imports it."""
    root = tmp_path / "tree"
    shutil.copytree(ROOT / "sharded_exp", root / "sharded_exp", ignore=shutil.ignore_patterns("__pycache__"))
    for path, body in files.items():
        target = root / path
        assert not target.exists(), f"the walkthrough's {path} already exists in the package"
        target.write_text(body)
    for path, name, lines in edits:
        target = root / path
        assert target.exists(), f"the walkthrough edits {path}, which the package does not have"
        target.write_text(add_at_end_of(target.read_text(), name, lines))
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


@pytest.mark.slow  # a doc's conformance, not a capability: a real job and a plan in a copied package
def test_the_add_a_memory_category_walkthrough_measures_and_plans_a_new_category(tmp_path):
    """The page adds ``Staging`` to the vocabulary's tables and a toy strategy that fills it:
    the job's measured peak names it, and so do the fake step's breakdown and the plan."""
    page = "add-a-memory-category.md"
    files = page_files(page)
    assert set(files) == {"sharded_exp/strategies/staged_ddp.py", "sharded_exp/conf/strategy/staged_ddp.yaml"}
    edits = page_edits(page)
    assert {(path, name) for path, name, _ in edits} == {
        ("sharded_exp/vocabulary/memory.py", name)
        for name in ("OWN_CATEGORIES", "TORCH_CATEGORIES", "PARTS", "MEANINGS", "MEASURED_CHART_PARTS",
                     "PREDICTED_CHART_PARTS")
    }  # fmt: skip
    env = package_with(tmp_path, files, edits)

    out = tmp_path / "run"
    proc = run_cli([*tiny(["strategy=staged_ddp"]), f"hydra.run.dir={out}"], cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = read_result(out)
    assert result["status"] == "ok"
    assert result["config"]["strategy"]["name"] == "staged_ddp"
    memory = result["memory"]
    assert memory["source"] == "torch_mem_tracker" and len(memory["per_rank"]) == 2
    for rank in memory["per_rank"]:
        peak = rank["peak_breakdown_mib"]
        # a flat copy of the parameters: as large as they are, and filed apart from the activations
        assert peak["Staging"] == pytest.approx(peak["Parameter"]) and peak["Staging"] > 0
    predicted = memory["peak_prediction"]["breakdown_mib"]  # the run's own fake step
    assert predicted["staging"] == pytest.approx(predicted["params"]) and predicted["staging"] > 0

    plan = run_cli(
        ["model.hidden=32", "model.depth=2", "plan.strategies=[ddp,staged_ddp]", "plan.world_sizes=[2]",
         "plan.device=cpu", "plan.format=json"],
        cwd=tmp_path, env=env, timeout=240, module="sharded_exp.plan",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-3000:]
    rows = {row["strategy"]: row for row in json.loads(plan.stdout)["rows"]}
    assert set(rows) == {"ddp", "staged_ddp"}
    # The fake step runs the strategy's build under the tracker: the copy is filed as staging.
    staged, ddp = rows["staged_ddp"], rows["ddp"]
    assert staged["staging_gib"] == pytest.approx(staged["params_gib"]) and staged["staging_gib"] > 0
    assert ddp["staging_gib"] == 0
    assert staged["total_gib"] == pytest.approx(ddp["total_gib"] + staged["staging_gib"])


def test_the_walkthrough_pages_are_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in ("add-a-strategy.md", "add-a-memory-category.md"):
        assert f"development/{page}" in nav
        assert os.path.exists(ROOT / "docs" / "development" / page)
