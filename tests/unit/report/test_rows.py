"""sharded_exp.report.rows: one row per point from hand-written result.json dicts: its figures, the baseline of each group (DDP, else the least sharded point that fits), savings, speed ratios and "within noise", the columns."""

from __future__ import annotations

import math

import pytest

from sharded_exp.report.rows import (
    COLUMNS,
    build_rows,
    columns,
    measured,
    oom_summary,
    point_row,
    series_keys,
    series_label,
    swept_of,
)
from tests.helpers.unit_output import pair, point, rows_by


def test_a_row_reads_its_figures_from_the_result():
    p = point("fsdp", 4, n=3, peak=2.5, states=1.25, predicted=2.6, rel_error=0.04, sps=7.0, limit=64.0,
              final_loss=0.5, eval={"final": {"eval/accuracy": 0.9}}, device={"type": "cpu", "threads_per_rank": 1})  # fmt: skip
    p["memory"]["oom_breakdown"] = {"rank": 0, "tracked_mib": 9.5, "by_category_mib": {"Parameter": 9.5}}
    row = point_row(p)
    assert (row["strategy"], row["world_size"], row["precision"], row["model"]) == ("fsdp", 4, "32", "mlp")
    assert row["peak_allocated_mib_max"] == 2.5 and row["model_states_mib_max"] == 1.25
    assert row["predicted_peak_mib_max"] == 2.6 and row["peak_rel_error_max"] == 0.04
    assert row["memory_limit_mib"] == 64.0 and row["samples_per_s"] == 7.0 and row["final_loss"] == 0.5
    assert row["eval/accuracy"] == 0.9 and row["eval/f1"] is None
    assert row["device"] == "cpu" and row["threads_per_rank"] == 1
    assert row["oom_at_mib"] == 9.5 and row["oom_categories"] == {"Parameter": 9.5}


def test_a_row_of_an_empty_result_has_placeholders_not_errors():
    row = point_row({})
    assert (row["strategy"], row["world_size"], row["precision"], row["status"]) == ("?", 0, "?", "?")
    assert row["peak_allocated_mib_max"] is None and row["per_rank"] == [] and row["oom_breakdown"] is None


def test_an_older_result_without_a_mean_gets_the_average_of_its_ranks():
    per_rank = [{"rank": 0, "peak_allocated_mib": 2.0, "predicted_peak_mib": 3.0},
                {"rank": 1, "peak_allocated_mib": 4.0, "predicted_peak_mib": 5.0}]  # fmt: skip
    row = point_row({"memory": {"per_rank": per_rank}})
    assert row["peak_allocated_mib_mean"] == (2.0 + 4.0) / 2
    assert row["predicted_peak_mib_mean"] == (3.0 + 5.0) / 2
    per_rank[1]["peak_allocated_mib"] = None  # a rank without a figure: no mean rather than a wrong one
    assert point_row({"memory": {"per_rank": per_rank}})["peak_allocated_mib_mean"] is None
    # the recorded mean wins over the ranks'
    assert (
        point_row({"memory": {"per_rank": per_rank, "peak_allocated_mib_mean": 7.0}})["peak_allocated_mib_mean"] == 7.0
    )


def test_a_nan_peak_is_no_measurement():
    row = point_row(point("ddp", peak=3.0))
    assert measured(row)
    assert not measured({**row, "peak_allocated_mib_max": math.nan})
    assert not measured({**row, "peak_allocated_mib_max": None})
    assert not measured({**row, "status": "oom"})


def test_savings_are_relative_to_the_ddp_point():
    rows = rows_by(pair(), "strategy")
    fsdp, ddp = rows["fsdp"], rows["ddp"]
    assert fsdp["peak_saving_pct"] == pytest.approx(100 * (1 - 1.0 / 4.0))
    assert fsdp["peak_mean_saving_pct"] == pytest.approx(100 * (1 - 0.75 / 3.0))
    assert fsdp["states_saving_pct"] == pytest.approx(100 * (1 - 0.5 / 2.0))
    assert ddp["peak_saving_pct"] == 0.0 and ddp["states_saving_pct"] == 0.0
    assert fsdp["baseline"] == "ddp (point 1)" and fsdp["baseline_short"] == "ddp"
    assert ddp["baseline"] == "itself" and ddp["baseline_short"] == "itself"


def test_a_larger_peak_than_the_baseline_is_a_negative_saving():
    rows = rows_by(pair(fsdp={"peak": 5.0}), "strategy")
    assert rows["fsdp"]["peak_saving_pct"] == pytest.approx(-25.0)


def test_speed_is_the_ratio_of_throughputs_with_a_conservative_interval():
    fsdp = rows_by(pair(), "strategy")["fsdp"]
    assert fsdp["speed_vs_baseline"] == pytest.approx(5.0 / 10.0)
    # the lowest over the highest, the highest over the lowest
    assert fsdp["speed_vs_baseline_ci95_low"] == pytest.approx(4.0 / 12.0)
    assert fsdp["speed_vs_baseline_ci95_high"] == pytest.approx(6.0 / 8.0)
    assert fsdp["speed_within_noise"] is False


def test_an_interval_that_holds_one_is_within_noise():
    fsdp = rows_by(pair(fsdp={"sps": 10.5, "ci": (9.0, 11.2)}), "strategy")["fsdp"]
    assert fsdp["speed_within_noise"] is True
    # its edge: an interval whose lower end is exactly 1.0 still holds it
    edge = rows_by(pair(ddp={"ci": (8.0, 10.0)}, fsdp={"sps": 11.0, "ci": (10.0, 12.0)}), "strategy")["fsdp"]
    assert edge["speed_vs_baseline_ci95_low"] == 1.0 and edge["speed_within_noise"] is True


def test_the_baseline_is_never_within_noise_of_itself_and_no_interval_says_nothing():
    rows = rows_by(pair(fsdp={"ci": None}), "strategy")
    assert rows["ddp"]["speed_vs_baseline"] == 1.0 and rows["ddp"]["speed_within_noise"] is None
    assert rows["fsdp"]["speed_vs_baseline"] == 0.5
    assert rows["fsdp"]["speed_vs_baseline_ci95_low"] is None and rows["fsdp"]["speed_within_noise"] is None


def test_parity_is_the_relative_difference_of_the_parameters_norm():
    rows = rows_by(pair(), "strategy")
    assert rows["fsdp"]["parity_vs_baseline"] == pytest.approx(abs(2.002 - 2.0) / 2.0)
    assert rows["ddp"]["parity_vs_baseline"] == 0.0


def test_a_point_that_did_not_finish_is_not_compared():
    rows = rows_by(pair(fsdp={"status": "oom"}), "strategy")
    oom = rows["fsdp"]
    assert oom["baseline"] == "ddp (point 1)"  # it has a baseline, but no figure against it
    for col in (
        "peak_saving_pct",
        "states_saving_pct",
        "speed_vs_baseline",
        "parity_vs_baseline",
        "speed_within_noise",
    ):
        assert oom[col] is None, col


def test_a_baseline_without_a_figure_gives_no_saving():
    rows = rows_by(pair(ddp={"states": None, "l2": None}), "strategy")
    assert rows["fsdp"]["states_saving_pct"] is None and rows["fsdp"]["parity_vs_baseline"] is None
    assert rows["fsdp"]["peak_saving_pct"] == pytest.approx(75.0)


def test_when_ddp_does_not_fit_the_least_sharded_point_that_fits_is_the_baseline():
    rows = rows_by(build_rows([
        point("ddp", n=1, status="oom", limit=3.0),
        point("fsdp", n=2, peak=1.0, sps=4.0),
        point("zero1", n=3, peak=2.5, sps=9.0),
        point("oss", n=4, peak=2.0, sps=8.0),  # as sharded as zero1 (level 1): oss before zero1 by name
    ]), "strategy")  # fmt: skip
    assert rows["fsdp"]["_base"] is rows["oss"]
    assert rows["fsdp"]["baseline"] == "oss (point 4): ddp (point 1) ended oom"
    assert rows["fsdp"]["baseline_short"] == "oss (ddp did not fit)"
    assert rows["fsdp"]["peak_saving_pct"] == pytest.approx(100 * (1 - 1.0 / 2.0))
    assert rows["fsdp"]["speed_vs_baseline"] == pytest.approx(4.0 / 8.0)
    assert rows["oss"]["baseline"] == "itself: ddp (point 1) ended oom" and rows["oss"]["baseline_short"] == "itself"
    assert rows["ddp"]["baseline"] == "oss (point 4): ddp (point 1) ended oom"
    assert rows["ddp"]["peak_saving_pct"] is None  # ddp ran out: nothing to compare


def test_among_repeats_of_the_least_sharded_strategy_the_lower_peak_is_the_baseline():
    seed = lambda s, i: ["strategy=" + s, f"trainer.seed={i}"]  # noqa: E731
    rows = build_rows([
        point("ddp", n=1, status="failed", overrides=seed("ddp", 1)),
        point("zero1", n=2, peak=3.0, overrides=seed("zero1", 1)),
        point("zero1", n=3, peak=2.0, overrides=seed("zero1", 2)),
        point("fsdp", n=4, peak=1.0, overrides=seed("fsdp", 1)),
    ])  # fmt: skip
    base = rows_by(rows, "_dir")["point 3"]
    assert all(r["_base"] is base for r in rows)
    assert rows_by(rows, "_dir")["point 4"]["baseline"] == "zero1 (point 3): ddp (point 1) ended failed"
    assert rows_by(rows, "_dir")["point 4"]["baseline_short"] == "zero1"  # not an out-of-memory: no aside


def test_without_a_ddp_twin_the_least_sharded_point_is_the_baseline_or_none():
    rows = rows_by(build_rows([point("fsdp", n=1, peak=1.0), point("sharded_ddp", n=2, peak=2.0)]), "strategy")
    assert rows["fsdp"]["baseline"] == "sharded_ddp (point 2): no ddp point with the same settings"
    assert rows["fsdp"]["peak_saving_pct"] == pytest.approx(50.0)
    (alone,) = build_rows([point("fsdp", n=1, peak=1.0)])
    assert alone["baseline"] == "none: no ddp point with the same settings" and alone["baseline_short"] == "none"
    assert alone["_base"] is None and alone["peak_saving_pct"] is None


def test_one_point_that_fits_beside_a_ddp_that_did_not_has_no_baseline():
    rows = rows_by(build_rows([point("ddp", n=1, status="oom"), point("oss", n=2, peak=2.0)]), "strategy")
    assert rows["oss"]["baseline"] == "none: ddp (point 1) ended oom" and rows["oss"]["_base"] is None


def test_points_are_compared_only_at_the_same_world_size():
    rows = rows_by(build_rows([
        point("ddp", 2, n=1, peak=4.0), point("fsdp", 2, n=2, peak=2.0),
        point("ddp", 4, n=3, peak=8.0), point("fsdp", 4, n=4, peak=2.0),
    ]), "strategy", "world_size")  # fmt: skip
    assert rows[("fsdp", 2)]["peak_saving_pct"] == pytest.approx(50.0)
    assert rows[("fsdp", 4)]["peak_saving_pct"] == pytest.approx(75.0)
    assert rows[("fsdp", 4)]["baseline"] == "ddp (point 3)"


def test_points_are_compared_only_at_the_same_precision_and_model():
    rows = rows_by(build_rows([
        point("ddp", n=1, peak=4.0), point("fsdp", n=2, peak=3.0),
        point("ddp", n=3, peak=2.0, precision="bf16"), point("fsdp", n=4, peak=1.0, precision="bf16"),
        point("fsdp", n=5, peak=1.0, model="gpt"),
    ]), "_dir")  # fmt: skip
    assert rows["point 2"]["peak_saving_pct"] == pytest.approx(25.0)
    assert rows["point 4"]["peak_saving_pct"] == pytest.approx(50.0)
    assert rows["point 5"]["baseline"] == "none: no ddp point with the same settings"


def test_two_models_of_one_name_and_two_sizes_are_two_settings_not_repeats():
    """Probed scripts name their model's class: a small and a large Classifier under DDP are
    not one setting measured twice, and neither is the other's baseline; a series names each
    by its size."""
    rows = rows_by(build_rows([point("ddp", n=1, peak=1.4, model="Classifier", params=13_130),
                               point("ddp", n=2, peak=26.9, model="Classifier", params=1_089_034),
                               point("fsdp", n=3, peak=20.0, model="Classifier", params=1_089_034)]), "_dir")  # fmt: skip
    assert rows["point 1"]["baseline"] == "itself" and rows["point 2"]["baseline"] == "itself"
    assert rows["point 1"]["peak_saving_pct"] == 0.0 and rows["point 3"]["peak_saving_pct"] == pytest.approx(
        25.7, abs=0.1
    )
    assert rows["point 3"]["baseline"] == "ddp (point 2)"
    keys = series_keys(list(rows.values()), [])
    assert keys == ["params"] and series_label(rows["point 1"], keys) == "ddp, Classifier of 13,130 parameters"
    deeper = [{"strategy": "ddp", "model": "gpt", "precision": "32", "params": n, "model.n_layers": d}
              for n, d in ((10, 2), (20, 4))]  # fmt: skip
    assert series_keys(deeper, ["model.n_layers"]) == ["model.n_layers"]  # the swept depth says the size


def test_points_are_compared_only_at_the_same_swept_override():
    ov = lambda s, b: [f"strategy={s}", f"trainer.batch_size={b}"]  # noqa: E731
    rows = rows_by(build_rows([
        point("ddp", n=1, peak=4.0, sps=10.0, overrides=ov("ddp", 8)),
        point("oss", n=2, peak=3.0, sps=5.0, overrides=ov("oss", 8)),
        point("ddp", n=3, peak=6.0, sps=20.0, overrides=ov("ddp", 16)),
        point("oss", n=4, peak=3.0, sps=30.0, overrides=ov("oss", 16)),
    ]), "strategy", "trainer.batch_size")  # fmt: skip
    assert rows[("oss", "8")]["baseline"] == "ddp (point 1)" and rows[("oss", "8")]["speed_vs_baseline"] == 0.5
    assert rows[("oss", "16")]["baseline"] == "ddp (point 3)" and rows[("oss", "16")]["speed_vs_baseline"] == 1.5
    assert rows[("oss", "16")]["peak_saving_pct"] == pytest.approx(50.0)


def test_a_repeat_under_another_seed_is_compared_with_the_first_ddp_point():
    seed = lambda s, i: ["strategy=" + s, f"trainer.seed={i}"]  # noqa: E731
    rows = rows_by(build_rows([
        point("ddp", n=1, peak=4.0, sps=10.0, overrides=seed("ddp", 1)),
        point("ddp", n=2, peak=4.0, sps=9.0, overrides=seed("ddp", 2)),
    ]), "_dir")  # fmt: skip
    assert rows["point 1"]["baseline"] == "itself"
    assert rows["point 2"]["baseline"] == "ddp (point 1)" and rows["point 2"]["speed_vs_baseline"] == pytest.approx(0.9)
    assert rows["point 2"]["trainer.seed"] == "2"


def test_rows_run_from_the_least_sharded_strategy_to_the_most_unknown_last():
    names = ["fsdp", "plugin", "zero1", "sharded_ddp", "ddp", "fsdp_grad_op", "oss"]
    rows = build_rows([point(s, n=i, peak=1.0) for i, s in enumerate(names)])
    assert [r["strategy"] for r in rows] == ["ddp", "oss", "zero1", "sharded_ddp", "fsdp_grad_op", "fsdp", "plugin"]


def test_rows_are_ordered_by_world_size_within_a_group():
    rows = build_rows([point("fsdp", 8, n=1), point("ddp", 4, n=2), point("ddp", 8, n=3), point("fsdp", 4, n=4)])
    assert [(r["world_size"], r["strategy"]) for r in rows] == [(4, "ddp"), (4, "fsdp"), (8, "ddp"), (8, "fsdp")]


def test_an_oom_breakdown_reads_largest_category_first_and_three_modules():
    text = oom_summary({
        "rank": 1, "step": 3, "phase": "backward", "tracked_mib": 5.5, "limit_mib": 5,
        "by_category_mib": {"Parameter": 1.0, "Gradient": 0.0, "Activation": 3.0, "Temp": 1.5},
        "top_modules_mib": {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0},
    })  # fmt: skip
    assert text == ("rank 1 step 3 (backward): 5.50 MiB over 5; Activation 3.00, Temp 1.50, Parameter 1.00; "
                    "top modules a 1.00, b 2.00, c 3.00")  # fmt: skip
    assert oom_summary({"rank": 0, "step": None, "phase": "build", "tracked_mib": 1.0, "limit_mib": 0.5}) == (
        "rank 0 (build): 1.00 MiB over 0.5; "
    )
    assert oom_summary(None) is None and oom_summary({}) is None


def test_the_columns_put_swept_overrides_after_the_model_and_the_baseline_last():
    ov = lambda s, b: [f"strategy={s}", f"trainer.batch_size={b}"]  # noqa: E731
    rows = build_rows([point("ddp", overrides=ov("ddp", 8)), point("ddp", n=1, overrides=ov("ddp", 16))])
    assert swept_of(rows) == ["trainer.batch_size"]
    cols = columns(rows)
    assert cols[:5] == ["strategy", "world_size", "precision", "model", "trainer.batch_size"]
    assert cols[5:-1] == COLUMNS[4:] and cols[-1] == "baseline"
    assert columns(pair()) == [*COLUMNS, "baseline"]


def test_a_series_is_told_apart_by_what_varies_and_by_swept_settings():
    rows = [{"strategy": "ddp", "model": "mlp", "precision": "32", "trainer.activation_checkpointing": "full"},
            {"strategy": "ddp", "model": "mlp", "precision": "bf16", "trainer.activation_checkpointing": "none"}]  # fmt: skip
    keys = series_keys(rows, ["trainer.activation_checkpointing"])
    assert keys == ["precision", "trainer.activation_checkpointing"]
    assert series_label(rows[1], keys) == "ddp, precision bf16, activation_checkpointing=none"
    both = [{**rows[0], "model": "gpt"}, rows[1]]
    assert series_label(both[0], series_keys(both, [])) == "ddp, gpt, precision 32"
