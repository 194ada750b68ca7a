"""sharded_exp.output.charts, lightly: how a figure and a world size are printed, and where the
planner's chart puts its labels at one world size. Drawing a
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


def test_at_one_world_size_each_label_sits_on_its_own_marker():
    # nearly equal peaks: at one shared x their labels had to be pushed apart, away from the markers
    rows = [{"strategy": s, "world_size": 2, "total_gib": gib, "fits": True}
            for s, gib in (("ddp", 0.0347), ("oss", 0.0339), ("zero1", 0.0339), ("fsdp", 0.0332))]  # fmt: skip
    fig = charts.plan_chart(rows, 80.0, "one world size")
    ax = fig.axes[0]
    markers = {line.get_label(): (line.get_xdata()[0], line.get_ydata()[0]) for line in ax.lines
               if not line.get_label().startswith("_")}  # fmt: skip
    assert len({x for x, _ in markers.values()}) == len(rows)  # every line its own place
    labels = [t for t in ax.texts if t.get_text() != "device memory 80 GiB"]
    assert {t.get_text() for t in labels} == {"0.0347", "0.0339", "0.0332"}
    assert sorted(t.xy for t in labels) == sorted(markers.values())
    assert all(t.xyann == (0, 6) for t in labels)  # a few points above its marker, never pushed
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["ddp", "oss", "zero1", "fsdp"]
    charts.pyplot().close(fig)
