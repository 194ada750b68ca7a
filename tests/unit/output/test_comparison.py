"""sharded_exp.output.comparison: the sweep report built from hand-written result.json dicts:
reading the points, one row per point, the baseline of each group (DDP, else the least
sharded point that fits), savings, speed ratios and their 95% intervals, "within noise",
the headline's sentences, the tables and the report's files."""

from __future__ import annotations

import csv
import math

import pytest

from sharded_exp.output import comparison as cmp
from tests.helpers.unit_output import point, write_point


def rows_by(rows, *keys):
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


def pair(ddp=None, fsdp=None):
    """DDP (point 1: 4 MiB, 10 samples/s in 8-12) and FSDP (point 2: 1 MiB, 5 samples/s in 4-6)."""
    a = {"n": 1, "peak": 4.0, "mean": 3.0, "states": 2.0, "sps": 10.0, "ci": (8.0, 12.0), "l2": 2.0, **(ddp or {})}
    b = {"n": 2, "peak": 1.0, "mean": 0.75, "states": 0.5, "sps": 5.0, "ci": (4.0, 6.0), "l2": 2.002, **(fsdp or {})}
    return cmp.build_rows([point("ddp", **a), point("fsdp", **b)])


# ------------------------------------------------------------------------ one row per point
def test_a_row_reads_its_figures_from_the_result():
    p = point("fsdp", 4, n=3, peak=2.5, states=1.25, predicted=2.6, rel_error=0.04, sps=7.0, limit=64.0,
              final_loss=0.5, eval={"final": {"eval/accuracy": 0.9}}, device={"type": "cpu", "threads_per_rank": 1})  # fmt: skip
    p["memory"]["oom_breakdown"] = {"rank": 0, "tracked_mib": 9.5, "by_category_mib": {"Parameter": 9.5}}
    row = cmp._row(p)
    assert (row["strategy"], row["world_size"], row["precision"], row["model"]) == ("fsdp", 4, "32", "mlp")
    assert row["peak_allocated_mib_max"] == 2.5 and row["model_states_mib_max"] == 1.25
    assert row["predicted_peak_mib_max"] == 2.6 and row["peak_rel_error_max"] == 0.04
    assert row["memory_limit_mib"] == 64.0 and row["samples_per_s"] == 7.0 and row["final_loss"] == 0.5
    assert row["eval/accuracy"] == 0.9 and row["eval/f1"] is None
    assert row["device"] == "cpu" and row["threads_per_rank"] == 1
    assert row["oom_at_mib"] == 9.5 and row["oom_categories"] == {"Parameter": 9.5}


def test_a_row_of_an_empty_result_has_placeholders_not_errors():
    row = cmp._row({})
    assert (row["strategy"], row["world_size"], row["precision"], row["status"]) == ("?", 0, "?", "?")
    assert row["peak_allocated_mib_max"] is None and row["per_rank"] == [] and row["oom_breakdown"] is None


def test_an_older_result_without_a_mean_gets_the_average_of_its_ranks():
    per_rank = [{"rank": 0, "peak_allocated_mib": 2.0, "predicted_peak_mib": 3.0},
                {"rank": 1, "peak_allocated_mib": 4.0, "predicted_peak_mib": 5.0}]  # fmt: skip
    row = cmp._row({"memory": {"per_rank": per_rank}})
    assert row["peak_allocated_mib_mean"] == (2.0 + 4.0) / 2
    assert row["predicted_peak_mib_mean"] == (3.0 + 5.0) / 2
    per_rank[1]["peak_allocated_mib"] = None  # a rank without a figure: no mean rather than a wrong one
    assert cmp._row({"memory": {"per_rank": per_rank}})["peak_allocated_mib_mean"] is None
    # the recorded mean wins over the ranks'
    assert (
        cmp._row({"memory": {"per_rank": per_rank, "peak_allocated_mib_mean": 7.0}})["peak_allocated_mib_mean"] == 7.0
    )


def test_a_nan_peak_is_no_measurement():
    row = cmp._row(point("ddp", peak=3.0))
    assert cmp._measured(row)
    assert not cmp._measured({**row, "peak_allocated_mib_max": math.nan})
    assert not cmp._measured({**row, "peak_allocated_mib_max": None})
    assert not cmp._measured({**row, "status": "oom"})


def test_a_point_is_named_by_its_number_in_the_sweep_else_its_directory():
    assert cmp._point_name({"output_dir": "/s/12_strategy=fsdp"}) == "point 12"
    assert cmp._point_name({"output_dir": "/s/my_run"}) == "my_run"
    assert cmp._point_name({}) == "?"


def test_overrides_drop_plus_signs_and_quotes_and_fall_back_to_hydras_file(tmp_path):
    assert cmp._overrides({"overrides": ["+x=1", "++y.z=a", "precision='32'"]}) == {
        "x": "1",
        "y.z": "a",
        "precision": "32",
    }
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- strategy=oss\n- trainer.batch_size=8\n")
    assert cmp._overrides({"output_dir": str(tmp_path)}) == {"strategy": "oss", "trainer.batch_size": "8"}
    assert cmp._overrides({"output_dir": str(tmp_path / "none")}) is None


def test_swept_keys_are_the_overrides_that_differ_beyond_the_reports_own_columns():
    points = [
        point("ddp", overrides=["strategy=ddp", "trainer.world_size=2", "trainer.batch_size=8", "trainer.steps=4"]),
        point("oss", overrides=["strategy=oss", "trainer.world_size=4", "trainer.batch_size=16", "trainer.steps=4"]),
        {**point("oss", output_dir="/nowhere"), "overrides": None},  # unknown overrides: not counted
    ]
    assert cmp.swept_keys(points) == ["trainer.batch_size"]


# ------------------------------------------------------------------------ savings and speed
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


def test_speed_interval_needs_both_intervals_and_a_positive_lower_end():
    row = {"samples_per_s_ci95_low": 4.0, "samples_per_s_ci95_high": 6.0}
    assert cmp.speed_interval(row, {"samples_per_s_ci95_low": 2.0, "samples_per_s_ci95_high": 3.0}) == (
        4.0 / 3.0,
        6.0 / 2.0,
    )
    assert cmp.speed_interval(row, {"samples_per_s_ci95_low": 0.0, "samples_per_s_ci95_high": 3.0}) == (None, None)
    assert cmp.speed_interval(row, {"samples_per_s_ci95_low": None, "samples_per_s_ci95_high": 3.0}) == (None, None)


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


# ------------------------------------------------------------------------ the baseline of each point
def test_when_ddp_does_not_fit_the_least_sharded_point_that_fits_is_the_baseline():
    rows = rows_by(cmp.build_rows([
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
    rows = cmp.build_rows([
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
    rows = rows_by(cmp.build_rows([point("fsdp", n=1, peak=1.0), point("sharded_ddp", n=2, peak=2.0)]), "strategy")
    assert rows["fsdp"]["baseline"] == "sharded_ddp (point 2): no ddp point with the same settings"
    assert rows["fsdp"]["peak_saving_pct"] == pytest.approx(50.0)
    (alone,) = cmp.build_rows([point("fsdp", n=1, peak=1.0)])
    assert alone["baseline"] == "none: no ddp point with the same settings" and alone["baseline_short"] == "none"
    assert alone["_base"] is None and alone["peak_saving_pct"] is None


def test_one_point_that_fits_beside_a_ddp_that_did_not_has_no_baseline():
    rows = rows_by(cmp.build_rows([point("ddp", n=1, status="oom"), point("oss", n=2, peak=2.0)]), "strategy")
    assert rows["oss"]["baseline"] == "none: ddp (point 1) ended oom" and rows["oss"]["_base"] is None


def test_points_are_compared_only_at_the_same_world_size():
    rows = rows_by(cmp.build_rows([
        point("ddp", 2, n=1, peak=4.0), point("fsdp", 2, n=2, peak=2.0),
        point("ddp", 4, n=3, peak=8.0), point("fsdp", 4, n=4, peak=2.0),
    ]), "strategy", "world_size")  # fmt: skip
    assert rows[("fsdp", 2)]["peak_saving_pct"] == pytest.approx(50.0)
    assert rows[("fsdp", 4)]["peak_saving_pct"] == pytest.approx(75.0)
    assert rows[("fsdp", 4)]["baseline"] == "ddp (point 3)"


def test_points_are_compared_only_at_the_same_precision_and_model():
    rows = rows_by(cmp.build_rows([
        point("ddp", n=1, peak=4.0), point("fsdp", n=2, peak=3.0),
        point("ddp", n=3, peak=2.0, precision="bf16"), point("fsdp", n=4, peak=1.0, precision="bf16"),
        point("fsdp", n=5, peak=1.0, model="gpt"),
    ]), "_dir")  # fmt: skip
    assert rows["point 2"]["peak_saving_pct"] == pytest.approx(25.0)
    assert rows["point 4"]["peak_saving_pct"] == pytest.approx(50.0)
    assert rows["point 5"]["baseline"] == "none: no ddp point with the same settings"


def test_points_are_compared_only_at_the_same_swept_override():
    ov = lambda s, b: [f"strategy={s}", f"trainer.batch_size={b}"]  # noqa: E731
    rows = rows_by(cmp.build_rows([
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
    rows = rows_by(cmp.build_rows([
        point("ddp", n=1, peak=4.0, sps=10.0, overrides=seed("ddp", 1)),
        point("ddp", n=2, peak=4.0, sps=9.0, overrides=seed("ddp", 2)),
    ]), "_dir")  # fmt: skip
    assert rows["point 1"]["baseline"] == "itself"
    assert rows["point 2"]["baseline"] == "ddp (point 1)" and rows["point 2"]["speed_vs_baseline"] == pytest.approx(0.9)
    assert rows["point 2"]["trainer.seed"] == "2"


def test_rows_run_from_the_least_sharded_strategy_to_the_most_unknown_last():
    names = ["fsdp", "plugin", "zero1", "sharded_ddp", "ddp", "fsdp_grad_op", "oss"]
    rows = cmp.build_rows([point(s, n=i, peak=1.0) for i, s in enumerate(names)])
    assert [r["strategy"] for r in rows] == ["ddp", "oss", "zero1", "sharded_ddp", "fsdp_grad_op", "fsdp", "plugin"]


def test_rows_are_ordered_by_world_size_within_a_group():
    rows = cmp.build_rows([point("fsdp", 8, n=1), point("ddp", 4, n=2), point("ddp", 8, n=3), point("fsdp", 4, n=4)])
    assert [(r["world_size"], r["strategy"]) for r in rows] == [(4, "ddp"), (4, "fsdp"), (8, "ddp"), (8, "fsdp")]


# ------------------------------------------------------------------------ reading the sweep directory
def test_points_are_the_result_files_outside_attempts(tmp_path):
    write_point(tmp_path, "0_strategy=ddp", point("ddp"))
    write_point(tmp_path, "0_strategy=ddp/attempts/1", point("ddp"))
    write_point(tmp_path, "1_strategy=oss", point("oss"))
    assert sorted(p["strategy"] for p in cmp.load_points(tmp_path)) == ["ddp", "oss"]


def test_a_reused_directory_reports_the_current_sweeps_points_and_names_the_rest(tmp_path):
    (tmp_path / cmp.SWEEP_ID).write_text("new\n")
    write_point(tmp_path, "0_a", point("ddp", sweep_id="new"))
    write_point(tmp_path, "1_b", point("oss", sweep_id="old"))
    write_point(tmp_path, "2_c", "{broken")
    stale = []
    points = cmp.load_points(tmp_path, stale)
    assert sorted(p["status"] for p in points) == ["ok", "unreadable"]  # an unreadable point is always shown
    assert [p["strategy"] for p in stale] == ["oss"]
    assert cmp.sweep_id(tmp_path) == "new"


def test_a_sweep_id_file_that_is_empty_or_absent_is_no_id(tmp_path):
    assert cmp.sweep_id(tmp_path) is None
    (tmp_path / cmp.SWEEP_ID).write_text("\n")
    assert cmp.sweep_id(tmp_path) is None
    write_point(tmp_path, "0_a", point("ddp", sweep_id="any"))
    assert len(cmp.load_points(tmp_path)) == 1


@pytest.mark.parametrize(
    ("text", "why"),
    [("{not json", "Expecting property name"), ("[1, 2]", "a JSON list, not an object"),
     ('{"status": "ok", "world_size": "2"}', "does not match its schema: world_size"),
     ('{"schema_version": 99, "status": "ok", "strategy": "ddp", "world_size": 2, "precision": "32", "model": "mlp"}',
      "schema_version 99 is newer than this sharded_exp reads (1)")],
)  # fmt: skip
def test_an_unreadable_result_becomes_a_point_that_says_why(tmp_path, text, why):
    path = write_point(tmp_path, "0_x", text)
    (p,) = cmp.load_points(tmp_path)
    assert p["status"] == "unreadable" and p["error"].startswith(f"{path}: ") and why in p["error"]
    assert p["output_dir"] == str(path.parent)


def test_a_result_without_what_a_row_needs_is_incomplete_or_still_running(tmp_path):
    write_point(tmp_path, "0_x", {k: v for k, v in point("ddp").items() if k not in ("world_size", "model")})
    write_point(tmp_path, "1_y", {**{k: v for k, v in point("oss").items() if k != "world_size"}, "status": "running"})
    a, b = cmp.load_points(tmp_path)
    assert a["status"] == "incomplete" and a["error"].endswith(": incomplete (no world_size, model)")
    assert b["status"] == "running" and b["error"].endswith(
        ": still running or killed before it finished (no world_size)"
    )
    assert a["strategy"] == "ddp"  # what it holds is kept


# ------------------------------------------------------------------------ cells and tables
def test_an_oom_breakdown_reads_largest_category_first_and_three_modules():
    text = cmp.oom_summary({
        "rank": 1, "step": 3, "phase": "backward", "tracked_mib": 5.5, "limit_mib": 5,
        "by_category_mib": {"Parameter": 1.0, "Gradient": 0.0, "Activation": 3.0, "Temp": 1.5},
        "top_modules_mib": {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0},
    })  # fmt: skip
    assert text == ("rank 1 step 3 (backward): 5.50 MiB over 5; Activation 3.00, Temp 1.50, Parameter 1.00; "
                    "top modules a 1.00, b 2.00, c 3.00")  # fmt: skip
    assert cmp.oom_summary({"rank": 0, "step": None, "phase": "build", "tracked_mib": 1.0, "limit_mib": 0.5}) == (
        "rank 0 (build): 1.00 MiB over 0.5; "
    )
    assert cmp.oom_summary(None) is None and cmp.oom_summary({}) is None


@pytest.mark.parametrize(
    ("value", "cell"),
    [(None, "-"), (0.0, "0.00"), (1.234, "1.23"), (-0.5, "-0.50"), (0.01, "0.01"), (0.005, "5.00e-03"),
     (9999, "9999"), (12345, "12,345"), ("a|b\nc", "a\\|b c"), ("ok", "ok")],
)  # fmt: skip
def test_a_markdown_cell(value, cell):
    assert cmp._fmt(value) == cell


@pytest.mark.parametrize(
    ("ratio", "low", "high", "text"),
    [(0.52, 0.48, 0.57, "0.52x (0.48-0.57)"), (1.03, 0.91, 1.15, "1.03x (0.91-1.15, within noise)"),
     (1.1, 1.0, 1.2, "1.10x (1.00-1.20, within noise)"), (0.9, 0.8, 1.0, "0.90x (0.80-1.00, within noise)"),
     (1.3, 1.01, 1.6, "1.30x (1.01-1.60)"), (0.5, None, None, "0.50x (no interval: too few timed steps)")],
)  # fmt: skip
def test_speed_text_says_within_noise_only_when_the_interval_holds_one(ratio, low, high, text):
    row = {"speed_vs_baseline": ratio, "speed_vs_baseline_ci95_low": low, "speed_vs_baseline_ci95_high": high}
    assert cmp.speed_text(row) == text


def test_the_columns_put_swept_overrides_after_the_model_and_the_baseline_last():
    ov = lambda s, b: [f"strategy={s}", f"trainer.batch_size={b}"]  # noqa: E731
    rows = cmp.build_rows([point("ddp", overrides=ov("ddp", 8)), point("ddp", n=1, overrides=ov("ddp", 16))])
    assert cmp.swept_of(rows) == ["trainer.batch_size"]
    cols = cmp.columns(rows)
    assert cols[:5] == ["strategy", "world_size", "precision", "model", "trainer.batch_size"]
    assert cols[5:-1] == cmp.COLUMNS[4:] and cols[-1] == "baseline"
    assert cmp.columns(pair()) == [*cmp.COLUMNS, "baseline"]


def test_the_full_table_has_every_column_and_a_line_per_row():
    rows = pair()
    lines = cmp.markdown(rows).splitlines()
    assert lines[0] == "| " + " | ".join([*cmp.COLUMNS, "baseline"]) + " |"
    assert lines[1] == "|" + "---|" * (len(cmp.COLUMNS) + 1)
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| ddp | 2 | 32 | mlp | ") and lines[2].endswith(" | itself |")


def test_the_compact_table_shows_the_model_only_when_it_varies():
    header = cmp.compact(pair()).splitlines()[0]
    assert header == ("| strategy | world_size | precision | peak_allocated_mib_max | peak_allocated_mib_mean | "
                      "predicted_peak_mib_max | peak_saving_pct | samples_per_s | speed_vs_baseline | status | baseline |")  # fmt: skip
    fsdp_line = cmp.compact(pair()).splitlines()[3]
    assert fsdp_line == "| fsdp | 2 | 32 | 1.00 | 0.75 | - | 75.0 | 5.00 | 0.50x | ok | ddp |"
    rows = cmp.build_rows([point("ddp", peak=1.0), point("ddp", n=1, peak=1.0, model="gpt")])
    assert cmp.compact(rows).splitlines()[0].startswith("| strategy | world_size | precision | model | peak_allocated")


# ------------------------------------------------------------------------ the headline
def test_ranks_list_in_words():
    assert cmp._ranks_list([4, 1, 2]) == "1, 2 or 4 ranks"
    assert cmp._ranks_list([2, 8]) == "2 or 8 ranks"
    assert cmp._ranks_list([1]) == "1 rank"
    assert cmp._ranks_list([2]) == "2 ranks"
    assert cmp.limit_text(80.0) == " in 80 MiB" and cmp.limit_text(None) == ""


def test_the_headline_says_what_the_most_saving_strategy_saves_and_at_what_speed():
    assert (
        cmp.headline(pair())
        == "At 2 ranks, fsdp peaks 75% below ddp (1.00 vs 4.00 MiB) at 0.50x (0.33-0.75) its throughput."
    )


def test_the_headline_never_claims_a_speed_difference_within_noise():
    text = cmp.headline(pair(fsdp={"sps": 10.5, "ci": (9.0, 11.2)}))
    assert text == ("At 2 ranks, fsdp peaks 75% below ddp (1.00 vs 4.00 MiB) at the same throughput within noise "
                    "(1.05x, interval 0.75-1.40).")  # fmt: skip


def test_the_headline_names_the_fastest_only_when_it_is_out_of_noise():
    def rows(oss_ci):
        return cmp.build_rows([point("ddp", n=1, peak=4.0, sps=10.0, ci=(9.5, 10.5)),
                               point("oss", n=2, peak=3.0, sps=20.0, ci=oss_ci),
                               point("fsdp", n=3, peak=1.0, sps=5.0, ci=(4.0, 6.0))])  # fmt: skip

    assert cmp.headline(rows((19.0, 21.0))).endswith(" its throughput; oss is the fastest (20.00 samples/s).")
    assert "fastest" not in cmp.headline(rows((5.0, 30.0)))


def test_the_headline_says_why_the_baseline_is_not_ddp():
    fits = cmp.build_rows([point("ddp", n=1, status="oom", limit=3.0), point("oss", n=2, peak=2.0, sps=8.0),
                           point("fsdp", n=3, peak=1.0, sps=4.0)])  # fmt: skip
    assert cmp.headline(fits) == (
        "At 2 ranks, fsdp peaks 50% below oss (1.00 vs 2.00 MiB), the least sharded strategy that fits, at 0.50x "
        "(no interval: too few timed steps) its throughput. ddp does not fit in 3 MiB at 2 ranks."
    )
    no_ddp = cmp.build_rows([point("oss", n=2, peak=2.0), point("fsdp", n=3, peak=1.0)])
    assert "(1.00 vs 2.00 MiB), the least sharded strategy here." in cmp.headline(no_ddp)
    failed = cmp.build_rows(
        [point("ddp", n=1, status="failed"), point("oss", n=2, peak=2.0), point("fsdp", n=3, peak=1.0)]
    )
    assert "(1.00 vs 2.00 MiB), the least sharded that ran to the end. ddp failed at 2 ranks." in cmp.headline(failed)


def test_the_headline_when_the_baseline_has_the_lowest_peak():
    text = cmp.headline(pair(fsdp={"peak": 6.0}))
    assert text.startswith("At 2 ranks, ddp has the lowest peak (4.00 MiB)")


def test_the_headline_when_nothing_or_one_point_fits():
    none = cmp.build_rows([point("ddp", n=1, status="oom", limit=0.5), point("fsdp", n=2, status="oom", limit=0.5)])
    assert cmp.headline(none) == "At 2 ranks, nothing fits in 0.5 MiB. ddp and fsdp do not fit in 0.5 MiB at 2 ranks."
    one = cmp.build_rows([point("ddp", n=1, status="oom", limit=2.0), point("fsdp", n=2, peak=1.0)])
    assert cmp.headline(one) == "At 2 ranks, only fsdp fits in 2 MiB (1.00 MiB). ddp does not fit in 2 MiB at 2 ranks."
    alone = cmp.build_rows([point("ddp", n=1, peak=4.0, sps=10.0)])
    assert cmp.headline(alone) == "At 2 ranks, ddp peaks at 4.00 MiB (10.00 samples/s)."
    unlimited = cmp.build_rows([point("ddp", n=1, status="oom")])
    assert cmp.headline(unlimited) == "At 2 ranks, nothing fits. ddp runs out of memory at 2 ranks."


def test_the_headline_when_no_peak_was_measured_or_nothing_ran_to_the_end():
    nan = cmp.build_rows([point("ddp", n=1, peak=math.nan)])
    assert cmp.headline(nan) == "At 2 ranks, no point's peak was measured."
    failed = cmp.build_rows([point("ddp", n=1, status="failed"), point("fsdp", n=2, status="diverged")])
    assert (
        cmp.headline(failed) == "At 2 ranks, no point ran to the end. ddp failed at 2 ranks; fsdp diverged at 2 ranks."
    )


def test_points_that_did_not_finish_are_said_once_per_status_and_limit():
    rows = cmp.build_rows([
        point("ddp", 1, n=1, status="oom", limit=80.0), point("ddp", 2, n=2, status="oom", limit=80.0),
        point("oss", 1, n=3, status="oom", limit=80.0), point("zero1", 4, n=4, status="diverged"),
        point("fsdp", 4, n=5, status="stopped"),
    ])  # fmt: skip
    assert cmp._did_not_finish(rows) == (
        "ddp does not fit in 80 MiB at 1 or 2 ranks, oss at 1 rank; zero1 diverged at 4 ranks; fsdp was stopped at 4 ranks."
    )
    other_limit = cmp.build_rows(
        [point("ddp", 1, n=1, status="oom", limit=80.0), point("oss", 2, n=2, status="oom", limit=40.0)]
    )
    assert cmp._did_not_finish(other_limit) == "ddp does not fit in 80 MiB at 1 rank, oss in 40 MiB at 2 ranks."
    assert cmp._did_not_finish(pair()) == ""


def test_the_headline_says_a_repeat_is_the_noise_itself():
    seed = lambda s, i: ["strategy=" + s, f"trainer.seed={i}"]  # noqa: E731
    rows = cmp.build_rows([
        point("ddp", n=1, peak=4.0, sps=10.0, ci=(8.0, 12.0), overrides=seed("ddp", 1)),
        point("ddp", n=2, peak=4.0, sps=9.0, ci=(8.0, 10.0), overrides=seed("ddp", 2)),
        point("fsdp", n=3, peak=1.0, sps=5.0, ci=(4.0, 6.0), overrides=seed("fsdp", 1)),
    ])  # fmt: skip
    assert cmp.headline(rows).endswith("; a repeat of ddp (point 2) runs at 0.90x (0.67-1.25, within noise) its speed.")


def test_a_headline_per_group_with_its_settings_first():
    rows = cmp.build_rows([point("ddp", n=1, peak=4.0), point("fsdp", n=2, peak=1.0),
                           point("ddp", n=3, peak=2.0, precision="bf16"), point("fsdp", n=4, peak=1.0, precision="bf16")])  # fmt: skip
    text = cmp.headline(rows)
    assert text.startswith("**precision 32**: At 2 ranks, fsdp peaks 75% below ddp")
    assert " **precision bf16**: At 2 ranks, fsdp peaks 50% below ddp" in text


def test_the_headline_counts_points_without_a_usable_result():
    rows = cmp.build_rows([point("ddp", n=1, peak=4.0, sps=1.0), {"status": "unreadable", "output_dir": "/s/7_x"}])
    assert cmp.headline(rows).endswith(" 1 point(s) left no usable result.json (point 7).")


def test_the_headline_says_how_close_the_predictions_came():
    close = pair(ddp={"rel_error": 0.02}, fsdp={"rel_error": -0.03})
    assert cmp.headline(close).endswith(
        " Every rank's predicted peak is within 3.0% of its measured one (largest: fsdp at 2 ranks, -3.0%: too low)."
    )
    far = pair(ddp={"rel_error": 0.02}, fsdp={"rel_error": 0.08})
    assert cmp.headline(far).endswith(
        " At 1 of 2 points that ran, a rank's predicted peak is more than 5% off its measured one "
        "(worst: fsdp at 2 ranks, +8.0%: too high)."
    )
    edge = pair(fsdp={"rel_error": 0.05})  # on the band's edge: within it
    assert "Every rank's predicted peak is within 5.0%" in cmp.headline(edge)
    oom = pair(fsdp={"rel_error": 0.5, "status": "oom"})  # a point that did not run is not counted
    assert "predicted" not in cmp.headline(oom)


# ------------------------------------------------------------------------ notes and the report
def test_speed_notes_say_where_the_figures_come_from():
    rows = cmp.build_rows([point("ddp", n=1, sps=10.0, timed_steps=20, load=1.0, cpus=2, device={"type": "cpu"})])
    assert cmp.speed_notes(rows).endswith("Points: point 1 (ddp x2: cpu, load 1.0 on 2 cores, 20 timed steps).")
    assert cmp.speed_notes(cmp.build_rows([point("ddp")])) == "Speed: no point was timed."


def test_speed_notes_warn_of_few_timed_steps_and_of_a_loaded_machine():
    rows = cmp.build_rows([
        point("ddp", n=1, sps=10.0, timed_steps=3, min_timed_steps=10, load=3.5, cpus=2),
        point("fsdp", n=2, sps=5.0, timed_steps=10, min_timed_steps=10, load=2.0, cpus=2),  # at the edge: fine
    ])  # fmt: skip
    text = cmp.speed_notes(rows)
    assert "**Few timed steps:** point 1 (3 of trainer.min_timed_steps=10): their intervals are wide" in text
    assert "**Warning:** the machine's load exceeded its cores while point 1 (3.5 on 2) ran:" in text
    assert "point 2" not in text.split("**Few timed steps:**")[1]


def test_the_report_links_only_the_charts_drawn():
    md = cmp.report_markdown(pair(), "sw", drawn={"memory.png"})
    assert md.startswith("# Sweep report: sw\n\nAt 2 ranks, fsdp peaks 75% below ddp")
    assert "![Peak memory per rank vs world size](memory.png)" in md and "throughput.png" not in md
    assert "No chart: no point has a usable result." in cmp.report_markdown(pair(), "sw", drawn=set())
    assert all(f"]({name})" in cmp.report_markdown(pair(), "sw") for name in cmp.CHARTS)


def test_write_report_writes_the_tables_and_names_stale_points(tmp_path, monkeypatch):
    monkeypatch.setattr(cmp, "write_charts", lambda rows, where: [])
    (tmp_path / cmp.SWEEP_ID).write_text("s1")
    write_point(tmp_path, "1_strategy=ddp", point("ddp", n=1, peak=4.0, sps=10.0, sweep_id="s1"))
    write_point(tmp_path, "2_strategy=fsdp", point("fsdp", n=2, peak=1.0, sps=5.0, sweep_id="s1"))
    write_point(tmp_path, "3_strategy=oss", point("oss", n=3, peak=1.0, sweep_id="s0"))
    (tmp_path / "memory.png").write_bytes(b"an earlier report's chart")
    rows = cmp.write_report(tmp_path)
    assert [r["strategy"] for r in rows] == ["ddp", "fsdp"]
    table = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert list(table[0]) == cmp.columns(rows)
    assert [(r["strategy"], r["peak_saving_pct"]) for r in table] == [("ddp", "0.0"), ("fsdp", "75.0")]
    md = (tmp_path / "report.md").read_text()
    assert "1 point(s) left here by an earlier sweep are not in this report: point 3." in md
    assert not (tmp_path / "memory.png").exists()  # not drawn this time: report.md no longer links it
    assert not list(tmp_path.glob(".report-*"))  # the staging directory is gone


def test_write_report_of_an_empty_directory_writes_nothing(tmp_path):
    assert cmp.write_report(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_charts_are_drawn_only_for_points_with_a_world_size(tmp_path):
    rows = cmp.build_rows([{"status": "unreadable", "output_dir": "/s/0_x"}])
    assert cmp.write_charts(rows, tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_sweep_without_wandb_logs_no_report_run(tmp_path):
    cmp.log_to_wandb(pair(), [point("ddp")], [], tmp_path)  # logger none: returns before importing wandb
    assert list(tmp_path.iterdir()) == []
