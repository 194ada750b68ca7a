"""sharded_exp.report.text: the headline's sentences, the cells and the tables, the speed notes and report.md."""

from __future__ import annotations

import math
import re

import pytest

from sharded_exp.report.figures import CHARTS
from sharded_exp.report.rows import COLUMNS, build_rows
from sharded_exp.report.text import (
    _did_not_finish,
    _fmt,
    _ranks_list,
    baseline_rule,
    compact,
    headline,
    limit_text,
    machine_text,
    markdown,
    planned_clause,
    planned_text,
    report_markdown,
    speed_notes,
    speed_text,
)
from sharded_exp.strategies import memory_of
from tests.helpers.unit_output import pair, point


@pytest.mark.parametrize(
    ("value", "cell"),
    [(None, "-"), (0.0, "0.00"), (1.234, "1.23"), (-0.5, "-0.50"), (0.01, "0.01"), (0.005, "5.00e-03"),
     (9999, "9999"), (12345, "12,345"), ("a|b\nc", "a\\|b c"), ("ok", "ok")],
)  # fmt: skip
def test_a_markdown_cell(value, cell):
    assert _fmt(value) == cell


@pytest.mark.parametrize(
    ("ratio", "low", "high", "text"),
    [(0.52, 0.48, 0.57, "0.52x (0.48-0.57)"), (1.03, 0.91, 1.15, "1.03x (0.91-1.15, within noise)"),
     (1.1, 1.0, 1.2, "1.10x (1.00-1.20, within noise)"), (0.9, 0.8, 1.0, "0.90x (0.80-1.00, within noise)"),
     (1.3, 1.01, 1.6, "1.30x (1.01-1.60)"), (0.5, None, None, "0.50x (no interval: too few timed steps)")],
)  # fmt: skip
def test_speed_text_says_within_noise_only_when_the_interval_holds_one(ratio, low, high, text):
    row = {"speed_vs_baseline": ratio, "speed_vs_baseline_ci95_low": low, "speed_vs_baseline_ci95_high": high}
    assert speed_text(row) == text


def test_the_full_table_has_every_column_and_a_line_per_row():
    rows = pair()
    lines = markdown(rows).splitlines()
    assert lines[0] == "| " + " | ".join([*COLUMNS, "baseline"]) + " |"
    assert lines[1] == "|" + "---|" * (len(COLUMNS) + 1)
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| ddp | 2 | 32 | mlp | ") and lines[2].endswith(" | itself |")


def test_the_compact_table_shows_the_model_only_when_it_varies():
    header = compact(pair()).splitlines()[0]
    assert header == ("| strategy | world_size | precision | peak_allocated_mib_max | peak_allocated_mib_mean | "
                      "predicted_peak_mib_max | peak_saving_pct | samples_per_s | speed_vs_baseline | status | baseline |")  # fmt: skip
    fsdp_line = compact(pair()).splitlines()[3]
    assert fsdp_line == "| fsdp | 2 | 32 | 1.00 | 0.75 | - | 75.0 | 5.00 | 0.50x | ok | ddp |"
    noisy = compact(pair(fsdp={"sps": 9.0, "ci": (7.0, 11.0)})).splitlines()[3]  # 0.58-1.38 holds 1
    assert "| 0.90x (noise) | ok |" in noisy
    rows = build_rows([point("ddp", peak=1.0), point("ddp", n=1, peak=1.0, model="gpt")])
    assert compact(rows).splitlines()[0].startswith("| strategy | world_size | precision | model | peak_allocated")


def test_ranks_list_in_words():
    assert _ranks_list([4, 1, 2]) == "1, 2 or 4 ranks"
    assert _ranks_list([2, 8]) == "2 or 8 ranks"
    assert _ranks_list([1]) == "1 rank"
    assert _ranks_list([2]) == "2 ranks"
    assert limit_text(80.0) == " in 80 MiB" and limit_text(None) == ""


def test_the_headline_says_what_the_most_saving_strategy_saves_and_at_what_speed():
    assert (
        headline(pair())
        == "At 2 ranks, fsdp peaks 75% below ddp (1.00 vs 4.00 MiB) at 0.50x (0.33-0.75) its throughput."
    )


def test_the_headline_never_claims_a_speed_difference_within_noise():
    text = headline(pair(fsdp={"sps": 10.5, "ci": (9.0, 11.2)}))
    assert text == ("At 2 ranks, fsdp peaks 75% below ddp (1.00 vs 4.00 MiB) at the same throughput within noise "
                    "(1.05x, interval 0.75-1.40).")  # fmt: skip


def test_the_headline_names_the_fastest_only_when_it_is_out_of_noise():
    def rows(oss_ci):
        return build_rows([point("ddp", n=1, peak=4.0, sps=10.0, ci=(9.5, 10.5)),
                               point("oss", n=2, peak=3.0, sps=20.0, ci=oss_ci),
                               point("fsdp", n=3, peak=1.0, sps=5.0, ci=(4.0, 6.0))])  # fmt: skip

    assert headline(rows((19.0, 21.0))).endswith(" its throughput; oss is the fastest (20.00 samples/s).")
    assert "fastest" not in headline(rows((5.0, 30.0)))


def test_the_headline_says_why_the_baseline_is_not_ddp():
    fits = build_rows([point("ddp", n=1, status="oom", limit=3.0), point("oss", n=2, peak=2.0, sps=8.0),
                           point("fsdp", n=3, peak=1.0, sps=4.0)])  # fmt: skip
    assert headline(fits) == (
        "At 2 ranks, fsdp peaks 50% below oss (1.00 vs 2.00 MiB), the least sharded strategy that fits, at 0.50x "
        "(no interval: too few timed steps) its throughput. ddp does not fit in 3 MiB at 2 ranks."
    )
    no_ddp = build_rows([point("oss", n=2, peak=2.0), point("fsdp", n=3, peak=1.0)])
    assert "(1.00 vs 2.00 MiB), the least sharded strategy here." in headline(no_ddp)
    failed = build_rows([point("ddp", n=1, status="failed"), point("oss", n=2, peak=2.0), point("fsdp", n=3, peak=1.0)])
    assert "(1.00 vs 2.00 MiB), the least sharded that ran to the end. ddp failed at 2 ranks." in headline(failed)


def test_the_headline_when_the_baseline_has_the_lowest_peak():
    text = headline(pair(fsdp={"peak": 6.0}))
    assert text.startswith("At 2 ranks, ddp has the lowest peak (4.00 MiB)")


def test_the_headline_when_nothing_or_one_point_fits():
    none = build_rows([point("ddp", n=1, status="oom", limit=0.5), point("fsdp", n=2, status="oom", limit=0.5)])
    assert headline(none) == "At 2 ranks, nothing fits in 0.5 MiB. ddp and fsdp do not fit in 0.5 MiB at 2 ranks."
    one = build_rows([point("ddp", n=1, status="oom", limit=2.0), point("fsdp", n=2, peak=1.0)])
    assert headline(one) == "At 2 ranks, only fsdp fits in 2 MiB (1.00 MiB). ddp does not fit in 2 MiB at 2 ranks."
    alone = build_rows([point("ddp", n=1, peak=4.0, sps=10.0)])
    assert headline(alone) == "At 2 ranks, ddp peaks at 4.00 MiB (10.00 samples/s)."
    unlimited = build_rows([point("ddp", n=1, status="oom")])
    assert headline(unlimited) == "At 2 ranks, nothing fits. ddp runs out of memory at 2 ranks."


def test_the_headline_when_no_peak_was_measured_or_nothing_ran_to_the_end():
    nan = build_rows([point("ddp", n=1, peak=math.nan)])
    assert headline(nan) == "At 2 ranks, no point's peak was measured."
    failed = build_rows([point("ddp", n=1, status="failed"), point("fsdp", n=2, status="diverged")])
    assert headline(failed) == "At 2 ranks, no point ran to the end. ddp failed at 2 ranks; fsdp diverged at 2 ranks."


def test_points_that_did_not_finish_are_said_once_per_status_and_limit():
    rows = build_rows([
        point("ddp", 1, n=1, status="oom", limit=80.0), point("ddp", 2, n=2, status="oom", limit=80.0),
        point("oss", 1, n=3, status="oom", limit=80.0), point("zero1", 4, n=4, status="diverged"),
        point("fsdp", 4, n=5, status="stopped"),
    ])  # fmt: skip
    assert _did_not_finish(rows) == (
        "ddp does not fit in 80 MiB at 1 or 2 ranks, oss at 1 rank; zero1 diverged at 4 ranks; fsdp was stopped at 4 ranks."
    )
    other_limit = build_rows(
        [point("ddp", 1, n=1, status="oom", limit=80.0), point("oss", 2, n=2, status="oom", limit=40.0)]
    )
    assert _did_not_finish(other_limit) == "ddp does not fit in 80 MiB at 1 rank, oss in 40 MiB at 2 ranks."
    assert _did_not_finish(pair()) == ""


def test_the_headline_says_a_repeat_is_the_noise_itself():
    seed = lambda s, i: ["strategy=" + s, f"trainer.seed={i}"]  # noqa: E731
    rows = build_rows([
        point("ddp", n=1, peak=4.0, sps=10.0, ci=(8.0, 12.0), overrides=seed("ddp", 1)),
        point("ddp", n=2, peak=4.0, sps=9.0, ci=(8.0, 10.0), overrides=seed("ddp", 2)),
        point("fsdp", n=3, peak=1.0, sps=5.0, ci=(4.0, 6.0), overrides=seed("fsdp", 1)),
    ])  # fmt: skip
    assert headline(rows).endswith("; a repeat of ddp (point 2) runs at 0.90x (0.67-1.25, within noise) its speed.")


def test_a_headline_per_group_with_its_settings_first():
    rows = build_rows([point("ddp", n=1, peak=4.0), point("fsdp", n=2, peak=1.0),
                           point("ddp", n=3, peak=2.0, precision="bf16"), point("fsdp", n=4, peak=1.0, precision="bf16")])  # fmt: skip
    text = headline(rows)
    assert text.startswith("**precision 32**: At 2 ranks, fsdp peaks 75% below ddp")
    assert " **precision bf16**: At 2 ranks, fsdp peaks 50% below ddp" in text


def test_the_headline_counts_points_without_a_usable_result():
    rows = build_rows([point("ddp", n=1, peak=4.0, sps=1.0), {"status": "unreadable", "output_dir": "/s/7_x"}])
    assert headline(rows).endswith(" 1 point(s) left no usable result.json (point 7).")


def test_the_headline_says_how_close_the_predictions_came():
    close = pair(ddp={"rel_error": 0.02}, fsdp={"rel_error": -0.03})
    assert headline(close).endswith(
        " Every rank's predicted peak is within 3.0% of its measured one (largest: fsdp at 2 ranks, -3.0%: too low)."
    )
    exact = pair(ddp={"rel_error": 0.0}, fsdp={"rel_error": -0.0003})  # not "-0.0%: too low"
    assert headline(exact).endswith(" Every rank's predicted peak matches its measured one (within 0.05%).")
    far = pair(ddp={"rel_error": 0.02}, fsdp={"rel_error": 0.08})
    assert headline(far).endswith(
        " At 1 of 2 points that ran, a rank's predicted peak is more than 5% off its measured one "
        "(worst: fsdp at 2 ranks, +8.0%: too high)."
    )
    edge = pair(fsdp={"rel_error": 0.05})  # on the band's edge: within it
    assert "Every rank's predicted peak is within 5.0%" in headline(edge)
    oom = pair(fsdp={"rel_error": 0.5, "status": "oom"})  # a point that did not run is not counted
    assert "predicted" not in headline(oom)


def test_the_machine_sentence_names_the_cpu_layouts_or_the_gpu():
    cpu = {"type": "cpu", "threads_per_rank": 1}
    rows = build_rows(
        [
            point("ddp", n=1, sps=10.0, device=cpu),
            point("ddp", 1, n=2, sps=9.0, device=cpu | {"threads_per_rank": 2}),
            point("fsdp", n=3, peak=1.0, device=cpu),
        ]
    )  # fmt: skip  (fsdp: not timed, not said)
    assert machine_text(rows) == "Speeds measured on this machine's CPU, gloo, 1 rank x 2 threads, 2 ranks x 1 thread."
    gpu = build_rows([point("ddp", n=1, sps=10.0, device={"type": "cuda", "name": "NVIDIA H200"})])
    assert machine_text(gpu) == "Speeds measured on NVIDIA H200, NCCL, a GPU per rank."
    assert machine_text(build_rows([point("ddp", n=1, sps=10.0)])) == ""  # no device recorded: nothing claimed
    both = build_rows(
        [point("ddp", n=1, sps=10.0, device=cpu), point("ddp", 4, n=2, sps=10.0, device={"type": "cuda"})]
    )
    assert (
        machine_text(both)
        == "Speeds measured on this machine's CPU, gloo, 2 ranks x 1 thread; on a GPU, NCCL, a GPU per rank."
    )


def _planned(rows, *steps, note="no trace"):
    for row, step in zip(rows, steps):
        row["_planned"] = {"profile": "h100_sxm", "step_time_s": step, "note": None if step else note}
    return rows


def test_the_planned_ratio_stands_beside_the_measured_one():
    ddp, fsdp = rows = _planned(pair(), 0.010, 0.0125)  # fsdp's step 1.25x ddp's: 0.80x its throughput
    assert planned_clause(fsdp, ddp) == ", planned 0.80x on h100_sxm"
    assert headline(rows).startswith(
        "At 2 ranks, fsdp peaks 75% below ddp (1.00 vs 4.00 MiB) at 0.50x (0.33-0.75) its throughput, planned 0.80x "
        "on h100_sxm. Planned: each point's config priced by the planner's time model on h100_sxm at its world size."
    )
    assert planned_clause(fsdp, _planned(pair(), None)[0]) == ""  # the baseline without a figure: no ratio


def test_the_planned_sentence_says_why_a_point_has_none():
    rows = _planned(pair(), 0.010, None, note="no op trace: boom")
    assert planned_text(rows) == (
        "Planned: each point's config priced by the planner's time model on h100_sxm at its world size "
        "(none for fsdp at 2 ranks: no op trace: boom)."
    )
    assert "planned" not in headline(rows).split(". ")[0]
    assert planned_text(_planned(pair(), None, None, note="it ran on a GPU")) == (
        "Planned speeds on h100_sxm: none (it ran on a GPU)."
    )
    assert planned_text(pair()) == ""  # no profile named


def test_speed_notes_say_where_the_figures_come_from():
    rows = build_rows([point("ddp", n=1, sps=10.0, timed_steps=20, load=1.0, cpus=2, device={"type": "cpu"})])
    assert speed_notes(rows).endswith("Points: point 1 (ddp x2: cpu, load 1.0 on 2 cores, 20 timed steps).")
    assert speed_notes(build_rows([point("ddp")])) == "Speed: no point was timed."


def test_speed_notes_warn_of_few_timed_steps_and_of_a_loaded_machine():
    rows = build_rows([
        point("ddp", n=1, sps=10.0, timed_steps=3, min_timed_steps=10, load=3.5, cpus=2),
        point("fsdp", n=2, sps=5.0, timed_steps=10, min_timed_steps=10, load=2.0, cpus=2),  # at the edge: fine
    ])  # fmt: skip
    text = speed_notes(rows)
    assert "**Few timed steps:** point 1 (3 of trainer.min_timed_steps=10): their intervals are wide" in text
    assert "**Warning:** the machine's load exceeded its cores while point 1 (3.5 on 2) ran:" in text
    assert "point 2" not in text.split("**Few timed steps:**")[1]


def test_the_report_links_only_the_charts_drawn():
    md = report_markdown(pair(), "sw", drawn={"memory.png"})
    assert md.startswith("# Sweep report: sw\n\nAt 2 ranks, fsdp peaks 75% below ddp")
    assert "![Peak memory per rank vs world size](memory.png)" in md and "throughput.png" not in md
    assert "No chart: no point has a usable result." in report_markdown(pair(), "sw", drawn=set())
    assert all(f"]({name})" in report_markdown(pair(), "sw") for name in CHARTS)


def test_the_headline_says_why_sharded_ddps_peak_grows_with_ranks():
    rows = build_rows([point("ddp", 2, n=1, peak=8.0), point("sharded_ddp", 2, n=2, peak=5.0),
                       point("ddp", 4, n=3, peak=8.0), point("sharded_ddp", 4, n=4, peak=6.0)])  # fmt: skip
    text = headline(rows)
    reason = memory_of("sharded_ddp").peak_grows_with_ranks
    assert f" sharded_ddp peaks higher at 4 ranks than at 2 (6.00 vs 5.00 MiB): {reason}." in text
    assert "one gradient reduce bucket per rank" in reason
    assert text.count("peaks higher") == 1  # ddp's flat peak and other strategies need no reason


def test_no_growth_is_explained_where_the_peak_does_not_grow_or_ran_at_one_world_size():
    falling = build_rows([point("sharded_ddp", 2, n=1, peak=6.0), point("sharded_ddp", 4, n=2, peak=5.0)])
    once = build_rows([point("sharded_ddp", 2, n=1, peak=6.0)])
    grew_without_reason = build_rows([point("oss", 2, n=1, peak=5.0), point("oss", 4, n=2, peak=6.0)])
    for rows in (falling, once, grew_without_reason):
        assert "peaks higher" not in headline(rows)


def test_the_sweeps_guide_orders_the_strategies_as_the_report_does():
    from pathlib import Path

    from sharded_exp.strategies import STRATEGIES, by_sharding

    page = (Path(__file__).parents[3] / "sharded_exp" / "docs" / "guide" / "sweeps.md").read_text()
    (order,) = re.findall(r"\((ddp(?:\s*<\s*\w+)+)\)", page)
    assert re.split(r"\s*<\s*", order) == by_sharding(STRATEGIES.names())
    assert ", ".join(by_sharding(STRATEGIES.names())) in baseline_rule()
