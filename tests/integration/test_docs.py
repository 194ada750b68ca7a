"""The README's and the quickstart's commands run as written, and the docs say what they promise.

Every shell command in a ```bash block of README.md and docs/getting-started/quickstart.md is
read the way a shell reads it (``shlex``, comments dropped, ``&&`` splitting a line) and sorted
by the program it runs:

- training commands are composed by Hydra and checked by the parent's pre-flight, every point
  of a sweep (``-m``) apart, in the default tier; Hydra's questions (``--cfg job``) and
  ``sharded-exp-docs`` run for real there;
- in the slow tier each page's commands run for real, as written, one after another in a fresh
  working directory (the report reads the sweep the command before it wrote);
- what installs or tests (``scripts/setup.sh``, ``pip install``, ``pytest``) is held elsewhere,
  and named in :data:`ELSEWHERE` with where.

A command the test cannot sort fails it, so a new kind of command needs a decision here.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started" / "quickstart.md"]

MODULES = {
    "sharded-exp": "sharded_exp",
    "sharded-exp-plan": "sharded_exp.plan",
    "sharded-exp-report": "sharded_exp.report",
    "sharded-exp-docs": "sharded_exp.pages",
}
"""The console scripts and the modules they are (pyproject.toml's [project.scripts])."""

ELSEWHERE = {
    "scripts/setup.sh": "tests/integration/test_install.py runs it on a fresh venv and again with nothing changed",
    "pytest": "the README's test command is what CI runs (.ci/run)",
    "pip": "installs from an index or a built wheel: tests/integration/test_install.py installs the wheel in a fresh venv",
}
"""Programs the README names that this test does not run, and what holds them instead."""


def commands(page: Path) -> list[list[str]]:
    """Every command of the page's bash blocks, as argv lists, in the page's order."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(words[:cut])
                words = words[cut + 1 :]
    return out


def program(argv: list[str]) -> tuple[str, list[str]]:
    """(what runs, its arguments): a module for ``python -m M`` and the console scripts,
    else the program's own name."""
    exe = os.path.basename(argv[0])
    if exe in ("python", "python3") and argv[1:2] == ["-m"]:
        return argv[2], argv[3:]
    if exe in MODULES:
        return MODULES[exe], argv[1:]
    return argv[0], argv[1:]


def every_command() -> list[tuple[str, list[str]]]:
    return [(page.name, argv) for page in PAGES for argv in commands(page)]


def test_the_pages_hold_commands_and_each_is_sorted():
    found = every_command()
    assert len(found) >= 12, found  # the README and the quickstart show each command kind
    kinds = {program(argv)[0] for _, argv in found}
    known = {"sharded_exp", "sharded_exp.plan", "sharded_exp.report", "sharded_exp.pages", *ELSEWHERE}
    assert kinds <= known, f"commands this test does not know how to check: {sorted(kinds - known)}"
    assert {"sharded_exp", "sharded_exp.plan", "sharded_exp.report"} <= kinds


def sweep_points(args: list[str]) -> list[list[str]]:
    """A command line's points: one per combination of its swept values (Hydra's own parser:
    ``a,b``, ``glob(*)`` over a group's options, ``choice(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    from sharded_exp.compose import CONF_DIR

    axes = []
    for override in OverridesParser.create().parse_overrides([a for a in args if a not in ("-m", "--multirun")]):
        key = override.get_key_element()
        if not override.is_sweep_override():
            axes.append([f"{key}={override.get_value_element_as_str()}"])
        elif isinstance(override.value(), Glob):
            options = sorted(p.stem for p in (Path(CONF_DIR) / key).glob("*.yaml"))
            axes.append([f"{key}={o}" for o in override.value().filter(options)])
        else:
            axes.append([f"{key}={v}" for v in override.sweep_string_iterator()])
    return [list(p) for p in itertools.product(*axes)]


def run(module: str, args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("where,argv", every_command(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_command_composes_and_passes_the_pre_flight(where, argv, tmp_path):
    """What a command would run is a config Hydra composes and the parent accepts (every point
    of a sweep); a question (--cfg job) and the docs command run for real."""
    from sharded_exp.compose import compose
    from sharded_exp.launch import preflight
    from sharded_exp.plan.command import check_plan

    what, args = program(argv)
    if what in ELSEWHERE:
        pytest.skip(f"{what}: {ELSEWHERE[what]}")
    if what == "sharded_exp.pages" or "--cfg" in args:
        proc = run(what, args, cwd=ROOT, timeout=120)
        assert proc.returncode == 0 and proc.stdout, proc.stderr[-2000:]
        return
    if what == "sharded_exp.report":
        assert len(args) == 1 and args[0].startswith("outputs/"), args  # the sweep the page made before
        return
    points = sweep_points(args)
    assert points, args
    for point in points:
        if what == "sharded_exp.plan":
            check_plan(compose(point, "plan"), point)
        else:
            preflight.check(compose(point), str(tmp_path / "run"), peak=False)


@pytest.mark.slow
def test_each_command_runs_as_written(tmp_path):
    """Each page's commands, one after another, in a fresh working directory per page: each
    exits 0, a sweep leaves its report, and the report command rebuilds it. A command the same
    as one already run (the same program and arguments: a console script runs as its module)
    is not run twice; the report, which reads the sweep its own page made, always runs."""
    done: set = set()
    for page in PAGES:
        cwd = tmp_path / page.stem
        cwd.mkdir()
        ran = 0
        for argv in commands(page):
            what, args = program(argv)
            if what in ELSEWHERE:
                continue
            ran += 1
            if (what, tuple(args)) in done and what != "sharded_exp.report":
                continue
            done.add((what, tuple(args)))
            proc = run(what, args, cwd=cwd)
            assert proc.returncode == 0, f"{page.name}: {' '.join(argv)}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
            if "-m" in args:
                sweep = cwd / next(a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir="))
                assert (sweep / "report.md").exists() and len(list(sweep.glob("*/result.json"))) == len(
                    sweep_points(args)
                )
            if what == "sharded_exp.report":
                assert "report:" in proc.stdout and (cwd / args[0] / "report.md").exists()
            if what == "sharded_exp.plan":
                assert "fsdp" in proc.stdout and "ddp" in proc.stdout
        assert ran >= 6, page.name


def test_help_points_at_the_installed_docs():
    for module in ("sharded_exp", "sharded_exp.plan"):
        proc = run(module, ["--help"], cwd=ROOT, timeout=120)
        assert proc.returncode == 0 and "Docs: sharded-exp-docs" in proc.stdout, proc.stdout[-500:]
        assert "README" not in proc.stdout


def test_sharded_exp_docs_lists_and_prints_pages(capsys):
    from sharded_exp import pages

    assert pages.main([]) == 0
    listing = capsys.readouterr().out
    assert "getting-started/quickstart" in listing and "troubleshooting" in listing
    assert pages.main(["quickstart"]) == 0
    assert capsys.readouterr().out == (pages.DOCS_DIR / "getting-started" / "quickstart.md").read_text()
    assert pages.main(["guide"]) == 2  # several pages: named, none printed
    assert "matches" in capsys.readouterr().err


def test_the_site_lists_every_page_and_user_pages_name_no_test():
    """mkdocs.yml's nav holds every page (a page left out is one nobody finds); the pages a user
    reads name no test (tests belong in development/); the README fits on a screen or two."""
    import yaml

    from sharded_exp.pages import DOCS_DIR, pages

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def leaves(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from leaves(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from leaves(value)

    assert {p.removesuffix(".md") for p in leaves(nav)} == set(pages())
    for name in pages():
        if name.startswith("development/"):
            continue
        text = (DOCS_DIR / f"{name}.md").read_text()
        assert not re.search(r"\btest_\w+|tests/test_", text), name
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_yaml_opens_with_its_command_line():
    from sharded_exp.compose import CONF_DIR

    for path in sorted(Path(CONF_DIR).rglob("*.yaml")):
        head = [line for line in path.read_text().splitlines()[:2] if line != "# @package _global_"]
        assert head and head[0].startswith(("# python -m sharded_exp", "# sharded-exp")), path
