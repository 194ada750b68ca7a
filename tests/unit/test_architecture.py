"""The tree's shape, pinned: no import circle between the parts of sharded_exp.

Read from the source (every import, function-local ones too), not from what happens to be
imported: a circle hidden in a function still ties two parts together.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sharded_exp"


def _module(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The part a module belongs to: ``sharded_exp.<package or top-level module>``."""
    return ".".join(module.split(".")[:2])


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("sharded_exp.") and _part(target) != _part(module):
                    if _part(target) in _parts():
                        graph[_part(module)].add(_part(target))
    return graph


def _parts() -> set[str]:
    return {f"sharded_exp.{p.stem}" for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more parts (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _runs_later(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import runs after its module is loaded: inside a function, or never (``if TYPE_CHECKING``)."""
    while (node := parents.get(node)) is not None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def module_graph(package: Path = PACKAGE, *, later: bool = False) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports while it is loaded (with ``later``: every
    import it names, those inside functions and under ``TYPE_CHECKING`` too).

    ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``
    (its ``__init__.py``). A package's implicit import of its ``__init__`` is not an edge.
    """
    root = package.parent
    modules = {_module(path, root): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (not later and _runs_later(node, parents)):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[module] |= {t for t in targets if t in modules and t != module}
    return graph


def test_no_import_circle_between_the_parts_of_the_package():
    graph = import_graph()
    assert graph["sharded_exp.train"], "the graph is read (train imports other parts)"
    assert cycles(graph) == [], {v: sorted(graph[v]) for group in cycles(graph) for v in group}


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_the_files_of_the_package():
    """Between modules, not only packages: a circle between two files breaks as soon as one of them
    imports a name the other has not defined yet, and neither can be read without the other."""
    graph = module_graph()
    assert graph["sharded_exp.train.trainer"], "the graph is read (the trainer imports other modules)"
    assert cycles(graph) == [], {v: sorted(graph[v]) for group in cycles(graph) for v in group}
    # Nor through an import that runs later (inside a function, or under TYPE_CHECKING for the types
    # only): not a failure when the modules load, but the two files would still lean on each other.
    assert cycles(module_graph(later=True)) == [], "a circle through a later import"


def test_the_module_graph_finds_a_planted_circle(tmp_path):
    """A file circle made on purpose is found: at load time through a top-level import, and through a
    function-local one only when later imports are counted."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from ..a import name\n\ndef f():\n    from pkg import c\n")
    (package / "c.py").write_text("import pkg.sub.b\n")
    (package / "d.py").write_text("import pkg.a\n")
    assert cycles(module_graph(package)) == [["pkg.a", "pkg.sub.b"]]
    assert cycles(module_graph(package, later=True)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import b\n")
    assert cycles(module_graph(package)) == []


def function_local_imports(package: Path = PACKAGE) -> list[tuple[Path, ast.stmt, list[str]]]:
    """Every import inside a function: (file, the import, the file's lines)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                inside = node
                while (inside := parents.get(inside)) is not None:
                    if isinstance(inside, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.append((path, node, lines))
                        break
    return found


def _says_why(node: ast.stmt, lines: list[str]) -> bool:
    """A ``# lazy: <reason>`` on the import's own lines, or on a comment line above the group of
    imports it belongs to."""
    if any("# lazy:" in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    above = node.lineno - 2
    while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("# lazy:")


def test_an_import_inside_a_function_says_why_it_waits():
    """Imports sit at the top of their module; one that waits (torch before Hydra's questions are
    answered, an optional or heavy framework) says why, so the next reader does not move it up."""
    silent = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, node, lines in function_local_imports()
              if not _says_why(node, lines)]  # fmt: skip
    assert silent == []


def test_at_most_12_percent_of_the_imports_wait_inside_functions():
    """Issue 46's bound: at most 12% of the package's imports are function-local."""
    total = sum(
        isinstance(n, (ast.Import, ast.ImportFrom))
        for p in PACKAGE.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
    )
    local = len(function_local_imports())
    assert local <= 0.12 * total, f"{local} of {total} imports are inside functions"


MAX_FUNCTION_LINES = 80


def long_functions(package: Path = PACKAGE) -> list[str]:
    """Functions (and methods) of ``package`` longer than :data:`MAX_FUNCTION_LINES` lines, as ``path:line name (n)``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({n})")
    return found


def test_no_function_is_longer_than_80_lines(tmp_path):
    """Issue 46's bound: a function a newcomer reads whole, on one screen or two."""
    assert long_functions() == []
    planted = tmp_path / "pkg"
    planted.mkdir()
    (planted / "m.py").write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80)
    assert long_functions(planted) == ["pkg/m.py:5 long (81)"]


def test_the_lazy_import_checks_read_a_planted_file(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "import os\n\ndef f():\n    import json\n\ndef g():\n    # lazy: heavy\n    import a\n    import b\n\n"
        "def h():\n    import c  # lazy: heavy\n    if True:\n        import d\n"
    )
    found = {node.lineno: _says_why(node, lines) for _, node, lines in function_local_imports(package)}
    assert found == {4: False, 8: True, 9: True, 12: True, 14: False}


def test_prediction_is_beside_measurement_and_checkpoints_are_one_package():
    graph = import_graph()
    assert not (PACKAGE / "measure" / "prediction.py").exists() and (PACKAGE / "predict" / "prediction.py").exists()
    assert "sharded_exp.predict" not in graph["sharded_exp.measure"]  # measuring needs no prediction
    assert "sharded_exp.train" not in graph["sharded_exp.checkpoint"]  # the loop uses checkpoints, not the reverse


def test_the_vocabularies_import_no_other_part_and_the_planner_reads_its_parts_there():
    """Every part reads its names from sharded_exp.vocabulary, so it may import nothing of ours; the
    planner's points took the table's parts from plan.table, which imports plan.points (a circle)."""
    assert import_graph()["sharded_exp.vocabulary"] == set()
    assert not {m for m in _imports(PACKAGE / "plan" / "points.py") if m.startswith("sharded_exp.plan.table")}


def test_one_module_per_name():
    """Two modules of one name (two ``report``s) make a reader guess which one a name means.
    A command package (one with a ``__main__.py``: ``python -m sharded_exp.plan``) keeps its
    command line in ``command.py``, named like ``__main__.py`` by its role, not its content."""
    names = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        command = path.name == "command.py" and (path.parent / "__main__.py").exists()
        if path.name not in ("__init__.py", "__main__.py") and not command:
            names[path.stem].append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in names.items() if len(v) > 1} == {}


def test_every_package_directory_is_a_regular_package():
    """setuptools' find_packages skips a directory without __init__.py: a wheel would lack it.
    conf/ and docs/ are data (pyproject.toml's package-data ships them; the wheel test reads both)."""
    data = ("conf", "docs")
    dirs = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and not set(data) & set(p.parts)]
    assert [str(d) for d in dirs if not (d / "__init__.py").exists()] == []


# ------------------------------------------------------------------ the test suite's shape
TESTS = ROOT / "tests"


def _imports(path: Path) -> set[str]:
    """Every module a file imports (function-local imports too), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_test_module_imports_another():
    """What several test modules share lives in tests/helpers/ (or is a fixture)."""
    offenders = {}
    for path in TESTS.rglob("*.py"):
        hits = sorted(m for m in _imports(path) if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_"))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}


def test_conftest_files_hold_fixtures_and_hooks_only():
    for path in TESTS.rglob("conftest.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
                is_fixture = any(d.startswith(("pytest.fixture", "fixture")) for d in decorators)
                assert is_fixture or node.name.startswith("pytest_"), f"{path.relative_to(ROOT)}: {node.name}"


def test_unit_test_files_mirror_the_source_tree():
    """tests/unit/<package>/test_<module>.py tests sharded_exp/<package>/<module>.py (test_init.py:
    the package's __init__.py; test_main.py: its __main__.py), as Lightning's tests_fabric mirrors src/lightning/fabric."""
    unmatched = []
    for path in (TESTS / "unit").rglob("test_*.py"):
        rel = path.relative_to(TESTS / "unit")
        module = rel.name.removeprefix("test_")
        source = PACKAGE / rel.parent / {"init.py": "__init__.py", "main.py": "__main__.py"}.get(module, module)
        if not source.exists() and rel != Path("test_architecture.py"):
            unmatched.append(str(rel))
    assert unmatched == []


def test_the_unit_tier_starts_no_process_and_no_job():
    """Unit tests run in-process: a real job, a subprocess or a rank belongs to tests/integration/."""
    banned = {"subprocess", "multiprocessing", "tests.helpers.jobs.launch_job", "tests.helpers.jobs.run_cli",
              "sharded_exp.launch.parent.launch", "torch.multiprocessing"}  # fmt: skip
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & banned) for p in (TESTS / "unit").rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
