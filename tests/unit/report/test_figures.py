"""sharded_exp.report.figures, lightly: the title's context, each peak's split into the chart's parts, which charts are drawn (drawing one imports matplotlib: tests/integration/test_report.py reads the drawn charts)."""

from __future__ import annotations

from sharded_exp.report.figures import breakdown_chart, context, measured_parts, predicted_parts, write_charts
from sharded_exp.report.rows import build_rows
from sharded_exp.vocabulary.memory import CHART_BUCKETS, CHART_PARTS


def test_charts_are_drawn_only_for_points_with_a_world_size(tmp_path):
    rows = build_rows([{"status": "unreadable", "output_dir": "/s/0_x"}])
    assert write_charts(rows, tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_the_title_context_lists_what_the_points_span():
    rows = [{"model": "mlp", "precision": "32", "device": "cpu", "batch_size": 8},
            {"model": "mlp", "precision": "16", "device": None, "batch_size": 8}]  # fmt: skip
    assert context(rows) == "model mlp, precision 16/32, cpu, batch 8/rank"
    assert context([{}]) == "model ?, precision ?, ?, batch ?/rank"


def test_the_measured_split_is_the_largest_ranks_in_the_charts_parts():
    row = {"per_rank": [
        {"peak_allocated_mib": 5.0, "peak_breakdown_mib": {"Parameter": 9.0}},
        {"peak_allocated_mib": 6.0, "peak_breakdown_mib": {"Parameter": 1.0, "Gradient": 1.0, "Optstate": 2.0,
                                                           "Activation": 1.5, "Temp": 0.25, "Buffer": 0.25, "New": 0.5}},
    ]}  # fmt: skip
    assert measured_parts(row) == {"parameters": 1.0, "gradients": 1.0, "optimizer state": 2.0,
                                   "communication buckets": 0.0, "activations": 1.5,
                                   "temporaries, other": 0.25 + 0.25 + 0.5}  # fmt: skip


def test_a_point_that_ran_out_is_split_by_what_was_live_and_none_without_figures():
    assert measured_parts({"oom_categories": {"Activation": 3.0, "Other": None}})["activations"] == 3.0
    assert measured_parts({"per_rank": [{"peak_allocated_mib": 1.0}]}) is None


def test_the_predicted_split_adds_gathered_units_to_parameters_and_the_step_to_optimizer_state():
    parts = predicted_parts({"peak_prediction": {"breakdown_mib": {
        "params": 1.0, "gathered": 0.5, "grads": 1.0, "optimizer": 2.0, "optimizer_step": 0.25,
        "activations": 3.0, "communication": 0.125, "unknown": 0.125}}})  # fmt: skip
    assert parts == {"parameters": 1.5, "gradients": 1.0, "optimizer state": 2.25, "communication buckets": 0.0,
                     "activations": 3.0, "temporaries, other": 0.25}  # fmt: skip
    assert predicted_parts({"peak_prediction": {}}) is None


def test_buckets_are_a_part_of_their_own_measured_and_predicted():
    measured = measured_parts({"per_rank": [{"peak_allocated_mib": 6.0,
                                             "peak_breakdown_mib": {"Bucket": 4.0, "Temp": 1.0}}]})  # fmt: skip
    predicted = predicted_parts({"peak_prediction": {"breakdown_mib": {"buckets": 4.0, "temporaries": 1.0}}})
    for parts in (measured, predicted):
        assert parts[CHART_BUCKETS] == 4.0 and parts["temporaries, other"] == 1.0


def test_the_breakdown_charts_legend_has_an_entry_and_a_colour_for_the_buckets():
    row = {"strategy": "sharded_ddp", "world_size": 4, "status": "ok", "model": "mlp", "precision": "32",
           "device": "cpu", "batch_size": 8,
           "per_rank": [{"peak_allocated_mib": 6.0, "peak_breakdown_mib": {"Parameter": 1.0, "Bucket": 4.0}}],
           "peak_prediction": {"breakdown_mib": {"params": 1.0, "buckets": 4.0}}}  # fmt: skip
    fig = breakdown_chart([row], [])
    legend = fig.axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == [*CHART_PARTS, "predicted"]
    colors = [tuple(h.get_facecolor()) for h in legend.legend_handles[: len(CHART_PARTS)]]
    assert len(set(colors)) == len(CHART_PARTS)  # the buckets are not drawn in the rest's grey
    import matplotlib.pyplot as plt

    plt.close(fig)
