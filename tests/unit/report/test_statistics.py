"""sharded_exp.report.statistics: the speed ratio's conservative 95% interval."""

from __future__ import annotations

from sharded_exp.report.statistics import speed_interval


def test_speed_interval_needs_both_intervals_and_a_positive_lower_end():
    row = {"samples_per_s_ci95_low": 4.0, "samples_per_s_ci95_high": 6.0}
    assert speed_interval(row, {"samples_per_s_ci95_low": 2.0, "samples_per_s_ci95_high": 3.0}) == (
        4.0 / 3.0,
        6.0 / 2.0,
    )
    assert speed_interval(row, {"samples_per_s_ci95_low": 0.0, "samples_per_s_ci95_high": 3.0}) == (None, None)
    assert speed_interval(row, {"samples_per_s_ci95_low": None, "samples_per_s_ci95_high": 3.0}) == (None, None)
