"""sharded_exp.output.charts, lightly: how a figure and a world size are printed, what tells
two lines apart, each peak's split into the chart's parts. Drawing a chart imports
matplotlib (over a second on its own): tests/integration/test_report.py reads the drawn charts."""

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


def test_a_series_is_told_apart_by_what_varies_and_by_swept_settings():
    rows = [{"strategy": "ddp", "model": "mlp", "precision": "32", "trainer.activation_checkpointing": "full"},
            {"strategy": "ddp", "model": "mlp", "precision": "bf16", "trainer.activation_checkpointing": "none"}]  # fmt: skip
    keys = charts.series_keys(rows, ["trainer.activation_checkpointing"])
    assert keys == ["precision", "trainer.activation_checkpointing"]
    assert charts.series_label(rows[1], keys) == "ddp, precision bf16, activation_checkpointing=none"
    both = [{**rows[0], "model": "gpt"}, rows[1]]
    assert charts.series_label(both[0], charts.series_keys(both, [])) == "ddp, gpt, precision 32"


def test_the_title_context_lists_what_the_points_span():
    rows = [{"model": "mlp", "precision": "32", "device": "cpu", "batch_size": 8},
            {"model": "mlp", "precision": "16", "device": None, "batch_size": 8}]  # fmt: skip
    assert charts.context(rows) == "model mlp, precision 16/32, cpu, batch 8/rank"
    assert charts.context([{}]) == "model ?, precision ?, ?, batch ?/rank"


def test_the_measured_split_is_the_largest_ranks_in_the_charts_parts():
    row = {"per_rank": [
        {"peak_allocated_mib": 5.0, "peak_breakdown_mib": {"Parameter": 9.0}},
        {"peak_allocated_mib": 6.0, "peak_breakdown_mib": {"Parameter": 1.0, "Gradient": 1.0, "Optstate": 2.0,
                                                           "Activation": 1.5, "Temp": 0.25, "Buffer": 0.25, "New": 0.5}},
    ]}  # fmt: skip
    assert charts.measured_parts(row) == {"parameters": 1.0, "gradients": 1.0, "optimizer state": 2.0,
                                          "activations": 1.5, "temporaries, other": 0.25 + 0.25 + 0.5}  # fmt: skip


def test_a_point_that_ran_out_is_split_by_what_was_live_and_none_without_figures():
    assert charts.measured_parts({"oom_categories": {"Activation": 3.0, "Other": None}})["activations"] == 3.0
    assert charts.measured_parts({"per_rank": [{"peak_allocated_mib": 1.0}]}) is None


def test_the_predicted_split_adds_gathered_units_to_parameters_and_the_step_to_optimizer_state():
    parts = charts.predicted_parts({"peak_prediction": {"breakdown_mib": {
        "params": 1.0, "gathered": 0.5, "grads": 1.0, "optimizer": 2.0, "optimizer_step": 0.25,
        "activations": 3.0, "communication": 0.125, "unknown": 0.125}}})  # fmt: skip
    assert parts == {"parameters": 1.5, "gradients": 1.0, "optimizer state": 2.25, "activations": 3.0,
                     "temporaries, other": 0.25}  # fmt: skip
    assert charts.predicted_parts({"peak_prediction": {}}) is None
