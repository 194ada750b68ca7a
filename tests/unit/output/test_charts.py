"""sharded_exp.output.charts, lightly: how a figure and a world size are printed. Drawing a
chart imports matplotlib (over a second on its own): tests/integration/test_plan.py and
tests/integration/test_report.py read the drawn charts."""

from __future__ import annotations

import pytest

from sharded_exp.output import charts


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0, "0.00"), (3.6612, "3.66"), (4.0, "4.00"), (99.999, "100.00"), (100.0, "100"),
     (6184.4, "6,184"), (0.08664, "0.0866"), (-250.0, "-250"), (-0.5, "-0.5")],
)  # fmt: skip
def test_a_figure_as_charts_and_tables_print_it(value, text):
    assert charts.num(value) == text


def test_world_sizes_in_words():
    assert charts.ranks(1) == "1 rank" and charts.ranks(2) == "2 ranks"
