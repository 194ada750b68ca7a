"""sharded_exp.vocabulary.memory: each memory category named once. torch's tracker names map
into ours, in the order result.json's breakdown keeps; every part has a heading and a meaning;
every category lands on one of the chart's bars; and no other module maps torch's names."""

from __future__ import annotations

import ast
from pathlib import Path

from sharded_exp.vocabulary import memory

PACKAGE = Path(memory.__file__).resolve().parents[1]


def test_torch_categories_map_into_our_parts():
    assert set(memory.TORCH_CATEGORIES.values()) <= set(memory.PARTS)
    assert memory.TORCH_CATEGORIES[memory.BUCKET] == "buckets" and memory.OTHER in memory.PARTS
    assert memory.TORCH_CATEGORIES["Unsharded Param"] == "gathered"  # FSDP's gathered units apart from params
    # our own tracker categories (filed_as) are mapped too, else a breakdown would call them "other"
    assert memory.BUCKET in memory.OWN_CATEGORIES and set(memory.OWN_CATEGORIES) <= set(memory.TORCH_CATEGORIES)
    assert set(memory.MODEL_STATES) <= set(memory.PARTS)


def test_the_fake_steps_breakdown_keeps_its_order():
    """result.json's ``breakdown_mib`` lists ours in the order they first appear in the table."""
    assert list(dict.fromkeys(memory.TORCH_CATEGORIES.values())) == [
        "params", "gathered", "grads", "optimizer", "activations", "temporaries", "communication", "other", "buckets",
    ]  # fmt: skip


def test_every_part_has_a_heading_and_a_meaning():
    assert len(set(memory.PARTS)) == len(memory.PARTS)
    assert memory.heading("optimizer") == "optim state" and memory.heading("grads") == "grads"
    assert [p for p in memory.PARTS if memory.heading(p) not in memory.MEANINGS] == [memory.OTHER]
    assert set(memory.MEANINGS) <= {memory.heading(p) for p in memory.PARTS}


def test_every_category_lands_on_one_chart_bar():
    assert len(memory.CHART_COLORS) == len(set(memory.CHART_COLORS)) == len(memory.CHART_PARTS)
    assert set(memory.MEASURED_CHART_PARTS.values()) <= set(memory.CHART_PARTS)
    assert set(memory.PREDICTED_CHART_PARTS.values()) <= set(memory.CHART_PARTS)
    assert set(memory.MEASURED_CHART_PARTS) <= set(memory.TORCH_CATEGORIES)
    assert set(memory.PREDICTED_CHART_PARTS) <= set(memory.PARTS)
    # the optimizer step's temporaries are drawn with the state: the CPU tracker files both so
    assert memory.PREDICTED_CHART_PARTS[memory.OPTIMIZER_STEP] == memory.PREDICTED_CHART_PARTS["optimizer"]


def _category_maps(path: Path) -> list[int]:
    """Lines of dict literals keyed by two or more of torch's tracker names."""
    torch_names = set(memory.TORCH_CATEGORIES)
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Dict)
        and len({k.value for k in node.keys if isinstance(k, ast.Constant)} & torch_names) >= 2
    ]


def test_no_other_module_maps_torch_categories():
    """A second table of torch's names drifts from this one (a new category filed as "other" in one place)."""
    here = Path(memory.__file__).resolve()
    offenders = {str(p.relative_to(PACKAGE)): _category_maps(p) for p in sorted(PACKAGE.rglob("*.py")) if p != here}
    assert {p: lines for p, lines in offenders.items() if lines} == {}


def test_the_check_finds_a_map_of_torch_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('A = {"Parameter": "p", "Gradient": "g"}\nB = {"Parameter": 1, "x": 2}\n')
    assert _category_maps(module) == [1]
