"""The report's arithmetic over measured figures: the mean over ranks, and the 95% interval
of a speed ratio built from the two medians' intervals.

The ranks measure the median step and its interval themselves (order statistics, in
result.json's ``throughput``); the report only combines what they wrote.
"""

from __future__ import annotations

from typing import Any

BAND = 0.05
"""A prediction within 5% of the measured peak is close: the headline says so, and the
predicted-vs-measured chart draws this band."""


def mean_over_ranks(mem: dict[str, Any], key: str) -> float | None:
    """``memory.<key>_mean``, or for a result.json written before it existed, the average of
    the ranks' ``<key>`` (None unless every rank has one)."""
    if f"{key}_mean" in mem:
        return mem[f"{key}_mean"]
    values = [e.get(key) for e in mem.get("per_rank") or []]
    return sum(values) / len(values) if values and all(v is not None for v in values) else None


def speed_interval(row: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, float | None]:
    """A 95% interval of ``row``'s speed over ``base``'s, from the two medians' intervals
    (the lowest over the highest, the highest over the lowest: a conservative interval,
    as the two are measured apart). (None, None) when either point timed too few steps."""
    a_low, a_high = row["samples_per_s_ci95_low"], row["samples_per_s_ci95_high"]
    b_low, b_high = base["samples_per_s_ci95_low"], base["samples_per_s_ci95_high"]
    if None in (a_low, a_high, b_low, b_high) or not b_low:
        return None, None
    return a_low / b_high, a_high / b_low
