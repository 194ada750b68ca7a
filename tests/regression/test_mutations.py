"""The mutation list stays true: every mutated line still exists, once, in its file, and every
test named as its catcher still exists (``python -m tests.regression.mutations check`` runs them)."""

from __future__ import annotations

import ast

import pytest

from tests.regression.mutations import MUTATIONS, ROOT


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: str(m.number))
def test_each_mutation_names_one_line_and_a_unit_test_that_exists(mutation):
    source = (ROOT / mutation.file).read_text()
    assert sum(mutation.old in line for line in source.splitlines()) == 1, mutation
    assert mutation.old != mutation.new
    module, name = mutation.caught_by.split("::")
    assert module.startswith("tests/unit/")
    tree = ast.parse((ROOT / module).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, mutation.caught_by


def test_the_mutations_cover_at_least_twelve_lines_across_the_package():
    assert len({(m.file, m.old) for m in MUTATIONS}) >= 12
    assert [m.number for m in MUTATIONS] == list(range(1, len(MUTATIONS) + 1))
