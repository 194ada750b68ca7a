"""The report's words: the headline computed from the sweep, the compact and the full
table, where the speed figures come from, and report.md around them.

The headline says, per group of points that differ only in the strategy and the world size,
what the most memory-saving strategy saves against its baseline and at what speed, what did
not finish, and how close the predictions came; it never claims a speed difference that the
intervals hold within noise.
"""

from __future__ import annotations

from typing import Any

from sharded_exp.errors import ConfigError
from sharded_exp.output.charts import num, ranks
from sharded_exp.report.figures import CHARTS
from sharded_exp.report.rows import columns, measured, series_keys, series_label, swept_of
from sharded_exp.report.statistics import BAND
from sharded_exp.strategies import STRATEGIES, baseline, by_sharding, memory_of

COMPACT = {
    "strategy": "strategy",
    "world_size": "world_size",
    "precision": "precision",
    "peak_allocated_mib_max": "peak_allocated_mib_max",
    "peak_allocated_mib_mean": "peak_allocated_mib_mean",
    "predicted_peak_mib_max": "predicted_peak_mib_max",
    "peak_saving_pct": "peak_saving_pct",
    "samples_per_s": "samples_per_s",
    "speed_vs_baseline": "speed_vs_baseline",
    "status": "status",
    "baseline_short": "baseline",
}
"""The table a reader reads first: column -> header (the end-of-run table's abbreviations)."""


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.2e}"
    if isinstance(value, int) and value > 9999:
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")  # one markdown cell


def _table(rows: list[dict[str, Any]], cols: list[str], headers: list[str], fmt=_fmt) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(c, row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """Every column, one row per point."""
    cols = columns(rows)
    return _table(rows, cols, cols, lambda c, v: _fmt(v))


def _compact_cell(col: str, value: Any) -> str:
    if value is None:
        return "-"
    if col == "peak_saving_pct":
        return f"{value:.1f}"
    if isinstance(value, float):
        return num(value)
    return _fmt(value)


def compact(rows: list[dict[str, Any]]) -> str:
    """The columns a reader reads first (:data:`COMPACT`), the swept overrides beside the
    strategy, the model only when it varies."""
    swept = swept_of(rows)
    cols = list(COMPACT)[:3] + (["model"] if len({r["model"] for r in rows}) > 1 else []) + swept + list(COMPACT)[3:]
    shown = [{**r, "speed_vs_baseline": _speed_cell(r)} for r in rows]
    return _table(shown, cols, [COMPACT.get(c, c) for c in cols], _compact_cell)


def _speed_cell(row: dict[str, Any]) -> str | None:
    """``0.52x``, or ``1.03x (noise)`` where its interval holds 1 (the interval itself: the full
    table and the headline)."""
    ratio = row["speed_vs_baseline"]
    return None if ratio is None else f"{ratio:.2f}x" + (" (noise)" if row.get("speed_within_noise") else "")


def speed_text(row: dict[str, Any]) -> str:
    """``0.52x (0.48-0.57)``, or ``1.03x (0.91-1.15, within noise)``."""
    ratio, low, high = (
        row["speed_vs_baseline"],
        row.get("speed_vs_baseline_ci95_low"),
        row.get("speed_vs_baseline_ci95_high"),
    )
    if low is None:
        return f"{ratio:.2f}x (no interval: too few timed steps)"
    return f"{ratio:.2f}x ({low:.2f}-{high:.2f}{', within noise' if low <= 1.0 <= high else ''})"


# ------------------------------------------------------------------------ the headline
def _ranks_list(sizes: list[int]) -> str:
    """[1, 2, 4] -> "1, 2 or 4 ranks"."""
    sizes = sorted(sizes)
    words = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    return f"{words} rank" + ("" if sizes == [1] else "s")


def _baseline_aside(base: dict[str, Any], members: list[dict[str, Any]]) -> str:
    """Why the baseline is not DDP, in the headline's words ("" when it is)."""
    ddp = next((r for r in members if r["strategy"] == baseline()), None)
    if base["strategy"] == baseline():
        return ""
    if ddp is None:
        return "the least sharded strategy here"
    return "the least sharded strategy that fits" if ddp["status"] == "oom" else "the least sharded that ran to the end"


def limit_text(limit: float | None) -> str:
    return f" in {limit:g} MiB" if limit else ""


def _at_world_size(ws: int, members: list[dict[str, Any]]) -> str:
    """One sentence on the points of one world size that differ only in the strategy."""
    fitting = [r for r in members if measured(r)]
    oom = [r for r in members if r["status"] == "oom"]
    within = limit_text(next((r["memory_limit_mib"] for r in oom if r["memory_limit_mib"]), None))
    unmeasured = [r for r in members if r["status"] == "ok" and not measured(r)]  # ran, but no (finite) peak
    if not fitting:
        if oom:
            return f"At {ranks(ws)}, nothing fits{within}."
        return f"At {ranks(ws)}, " + ("no point's peak was measured." if unmeasured else "no point ran to the end.")
    if len(fitting) == 1:
        (only,) = fitting
        peak = f"{num(only['peak_allocated_mib_max'])} MiB"
        if len(members) == 1:
            return f"At {ranks(ws)}, {only['strategy']} peaks at {peak} ({num(only['samples_per_s'])} samples/s)."
        verb = f"fits{within}" if oom else "has a measured peak" if unmeasured else "ran to the end"
        return f"At {ranks(ws)}, only {only['strategy']} {verb} ({peak})."
    base = fitting[0]["_base"]
    lowest = min(fitting, key=lambda r: r["peak_allocated_mib_max"])
    if lowest is base or base is None or lowest["peak_saving_pct"] is None:  # (a baseline without a peak)
        text = f"At {ranks(ws)}, {lowest['strategy']} has the lowest peak ({num(lowest['peak_allocated_mib_max'])} MiB)"
    else:
        aside = _baseline_aside(base, members)
        text = (
            f"At {ranks(ws)}, {lowest['strategy']} peaks {lowest['peak_saving_pct']:.0f}% below {base['strategy']} "
            f"({num(lowest['peak_allocated_mib_max'])} vs {num(base['peak_allocated_mib_max'])} MiB)"
            + (f", {aside}" if aside else "")
        )
        if lowest["speed_vs_baseline"]:
            text += ("," if aside else "") + _speed_clause(lowest) + planned_clause(lowest, base)
    fastest = max(fitting, key=lambda r: r["samples_per_s"] or 0)
    if fastest is not lowest and fastest is not base and fastest["samples_per_s"] and not fastest["speed_within_noise"]:
        text += f"; {fastest['strategy']} is the fastest ({num(fastest['samples_per_s'])} samples/s)"
    repeats = (
        [r for r in fitting if r is not base and r["strategy"] == base["strategy"] and r["speed_vs_baseline"]]
        if base is not None
        else []
    )
    for r in repeats:  # the same settings again (another trainer.seed): the noise itself
        text += f"; a repeat of {base['strategy']} ({r['_dir']}) runs at {speed_text(r)} its speed"
    return text + "."


def _speed_clause(row: dict[str, Any]) -> str:
    """The speed of the most saving point against its baseline, never claiming what noise could make."""
    if row["speed_within_noise"]:
        low, high = row["speed_vs_baseline_ci95_low"], row["speed_vs_baseline_ci95_high"]
        return f" at the same throughput within noise ({row['speed_vs_baseline']:.2f}x, interval {low:.2f}-{high:.2f})"
    return f" at {speed_text(row)} its throughput"


def planned_clause(row: dict[str, Any], base: dict[str, Any]) -> str:
    """``, planned 0.93x on h100_sxm``: the same ratio priced on the sweep's GPU profile
    (``report.device_profile``, :mod:`sharded_exp.report.planned`); "" where either point has none.
    The points differ only in the strategy, so their throughput ratio is the inverse of their
    step times'."""
    mine, theirs = row.get("_planned") or {}, base.get("_planned") or {}
    if not mine.get("step_time_s") or not theirs.get("step_time_s"):
        return ""
    return f", planned {theirs['step_time_s'] / mine['step_time_s']:.2f}x on {mine['profile']}"


def machine_text(rows: list[dict[str, Any]]) -> str:
    """Where the speed figures were measured, e.g. "Speeds measured on this machine's CPU,
    gloo, 1 rank x 2 threads, 2 ranks x 1 thread." or "Speeds measured on NVIDIA H200, NCCL,
    a GPU per rank."; "" when no point was timed on a recorded device."""
    timed = [r for r in rows if r.get("samples_per_s") and r.get("device")]
    places = []
    cpu = sorted({(r["world_size"], r.get("threads_per_rank")) for r in timed if r["device"] == "cpu"})
    if cpu:
        layouts = [f"{ranks(ws)} x {t} thread" + ("" if t == 1 else "s") if t else ranks(ws) for ws, t in cpu]
        places.append("this machine's CPU, gloo, " + ", ".join(layouts))
    gpus = sorted({r.get("device_name") or "a GPU" for r in timed if r["device"] == "cuda"})
    if gpus:
        places.append(" and ".join(gpus) + ", NCCL, a GPU per rank")
    return f"Speeds measured on {'; on '.join(places)}." if places else ""


def planned_text(rows: list[dict[str, Any]]) -> str:
    """The closing word on the planned ratios: what they are, and in one clause why a point
    has none (the first reason met), e.g. "Planned: each point's config priced by the planner
    on h100_sxm at its world size." ("" when the sweep names no profile)."""
    planned = [r for r in rows if r.get("_planned")]
    if not planned:
        return ""
    profile = planned[0]["_planned"]["profile"]
    missing = [r for r in planned if not r["_planned"]["step_time_s"]]
    if len(missing) == len(planned):
        return f"Planned speeds on {profile}: none ({missing[0]['_planned']['note']})."
    text = f"Planned: each point's config priced by the planner's time model on {profile} at its world size"
    if missing:
        first = missing[0]
        text += f" (none for {first['strategy']} at {ranks(first['world_size'])}: {first['_planned']['note']})"
    return text + "."


def _did_not_finish(members: list[dict[str, Any]]) -> str:
    """The points that did not finish, e.g. "ddp does not fit in 80 MiB at 1 or 2 ranks, oss
    at 1 rank; zero1 diverged at 4 ranks"."""
    clauses = []
    said_limit = None
    for status in ("oom", "failed", "diverged", "stopped"):
        where: dict[tuple, list[str]] = {}  # (world sizes, limit) -> strategies
        for name in dict.fromkeys(r["strategy"] for r in members):
            hit = [r for r in members if r["strategy"] == name and r["status"] == status]
            if hit:
                limits = {r["memory_limit_mib"] for r in hit}
                key = (tuple(sorted(r["world_size"] for r in hit)), limits.pop() if len(limits) == 1 else None)
                where.setdefault(key, []).append(name)
        parts = []
        for (sizes, limit), names in where.items():
            who = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            if not parts:
                verb = {"failed": "failed", "diverged": "diverged", "stopped": "was stopped"}.get(status)
                if status == "oom":
                    verb = (
                        ("does not fit" if len(names) == 1 else "do not fit") + limit_text(limit)
                        if limit
                        else ("runs out of memory" if len(names) == 1 else "run out of memory")
                    )
                    said_limit = limit
                parts.append(f"{who} {verb} at {_ranks_list(list(sizes))}")
            else:  # the verb said once
                other = limit_text(limit) if status == "oom" and limit != said_limit else ""
                parts.append(f"{who}{other} at {_ranks_list(list(sizes))}")
        if parts:
            clauses.append(", ".join(parts))
    return "; ".join(clauses) + "." if clauses else ""


def _growth_reason(strategy: str) -> str:
    """The strategy's own reason its peak grows with ranks (``MemoryModel.peak_grows_with_ranks``);
    "" for one with none, or not registered here (a plugin's point of an older sweep)."""
    try:
        return memory_of(strategy).peak_grows_with_ranks
    except ConfigError:
        return ""


def _peak_growth(members: list[dict[str, Any]]) -> str:
    """Why a strategy peaks higher at more ranks, once per strategy whose memory model gives a
    reason and whose measured peak is higher at its largest world size than at its smallest,
    e.g. "sharded_ddp peaks higher at 4 ranks than at 2 (6.00 vs 5.00 MiB): fairscale's ...".
    Sharding is expected to lower a peak, so a rise is explained rather than left to puzzle."""
    sentences = []
    for name in dict.fromkeys(r["strategy"] for r in members):
        ran = sorted((r for r in members if r["strategy"] == name and measured(r)), key=lambda r: r["world_size"])
        reason = _growth_reason(name) if len({r["world_size"] for r in ran}) > 1 else ""
        if reason and ran[-1]["peak_allocated_mib_max"] > ran[0]["peak_allocated_mib_max"]:
            small, large = ran[0], ran[-1]
            sentences.append(
                f"{name} peaks higher at {ranks(large['world_size'])} than at {small['world_size']} "
                f"({num(large['peak_allocated_mib_max'])} vs {num(small['peak_allocated_mib_max'])} MiB): {reason}."
            )
    return " ".join(sentences)


def headline(rows: list[dict[str, Any]]) -> str:
    """A few sentences computed from the sweep: per group of points that differ only in
    strategy and world size, what the most memory-saving strategy saves against the
    baseline at each world size and at what speed; what does not fit; how close the
    predictions came."""
    usable = [r for r in rows if r["world_size"]]
    swept = swept_of(rows)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in usable:
        groups.setdefault(row["_group"], []).append(row)
    varying = series_keys(usable, swept) if usable else []
    sentences = []
    for members in groups.values():
        prefix = ", ".join(series_label(members[0], varying).split(", ")[1:])
        said = [
            _at_world_size(ws, [r for r in members if r["world_size"] == ws])
            for ws in sorted({r["world_size"] for r in members})
        ]
        text = " ".join(t for t in [*said, _did_not_finish(members), _peak_growth(members)] if t)
        sentences.append((f"**{prefix}**: " if prefix and len(groups) > 1 else "") + text)
    sentences += [t for t in (machine_text(usable), planned_text(usable)) if t]
    bad = [r for r in rows if not r["world_size"]]
    if bad:
        sentences.append(f"{len(bad)} point(s) left no usable result.json ({', '.join(r['_dir'] for r in bad)}).")
    errors = [r for r in usable if measured(r) and r["peak_rel_error_max"] is not None]
    if errors:
        worst = max(errors, key=lambda r: abs(r["peak_rel_error_max"]))
        off = [r for r in errors if abs(r["peak_rel_error_max"]) > BAND]
        err = worst["peak_rel_error_max"]
        where = (
            f"{worst['strategy']} at {ranks(worst['world_size'])}, {err:+.1%}: {'too high' if err > 0 else 'too low'}"
        )
        if not off and abs(err) < 0.0005:  # -0.0% "too low" says nothing
            sentences.append("Every rank's predicted peak matches its measured one (within 0.05%).")
        elif not off:
            sentences.append(
                f"Every rank's predicted peak is within {abs(err):.1%} of its measured one (largest: {where})."
            )
        else:
            sentences.append(
                f"At {len(off)} of {len(errors)} points that ran, a rank's predicted peak is more than "
                f"{BAND:.0%} off its measured one (worst: {where})."
            )
    return " ".join(sentences)


def baseline_rule() -> str:
    return (
        "Memory in MiB per rank: the largest over ranks (`peak_allocated_mib_max`, what must fit) and the average "
        "over ranks (`peak_allocated_mib_mean`, the figure the seed study reported); `peak_saving_pct` (of the largest; "
        "`peak_mean_saving_pct`: of the average) and `speed_vs_baseline` compare each row "
        "with its `baseline`: the DDP point whose settings differ only in the strategy, or, where DDP did not run to "
        "the end, the least sharded point that fits at the same settings (in the order "
        + ", ".join(by_sharding(STRATEGIES.names()))
        + "). MFU is in percent (`mfu_pct`). Every column is in `report.csv` and at the end, named as in "
        "`result.json` and W&B."
    )


def speed_notes(rows: list[dict[str, Any]]) -> str:
    """Where the speed figures come from: the device, the threads each rank ran, the
    machine's load while each point was timed, and a warning where the load exceeded the
    cores (the steps then waited for other work: their speed is not the strategy's)."""
    timed = [r for r in rows if r.get("samples_per_s")]
    if not timed:
        return "Speed: no point was timed."
    where = []
    for r in timed:
        threads = f", {r['threads_per_rank']} thread(s) per rank" if r.get("threads_per_rank") else ""
        load = f", load {r['load_avg_1m']:.1f} on {r['cpu_count']} cores" if r.get("load_avg_1m") is not None else ""
        where.append(
            f"{r['_dir']} ({r['strategy']} x{r['world_size']}: {r.get('device') or '?'}{threads}{load}, "
            f"{r.get('timed_steps') or 0} timed steps)"
        )
    text = (
        "Speed: samples/s at the median step, with its 95% interval (order statistics); a ratio's interval "
        "is the two intervals' extremes, and a ratio whose interval holds 1.0 is within noise. On CPU the "
        "ranks share the cores: fewer ranks run more threads each. Points: " + "; ".join(where) + "."
    )
    few = [r for r in timed if r.get("min_timed_steps") and (r.get("timed_steps") or 0) < r["min_timed_steps"]]
    if few:
        text += (
            "\n\n**Few timed steps:** "
            + ", ".join(
                f"{r['_dir']} ({r.get('timed_steps') or 0} of trainer.min_timed_steps={r['min_timed_steps']})"
                for r in few
            )
            + ": their intervals are wide, and a difference among them may read as within noise."
        )
    loaded = [
        r
        for r in timed
        if r.get("load_avg_1m") is not None and r.get("cpu_count") and r["load_avg_1m"] > r["cpu_count"]
    ]
    if loaded:
        text += (
            "\n\n**Warning:** the machine's load exceeded its cores while "
            + ", ".join(f"{r['_dir']} ({r['load_avg_1m']:.1f} on {r['cpu_count']})" for r in loaded)
            + " ran: their speeds include waiting for other work."
        )
    return text


def report_markdown(rows: list[dict[str, Any]], name: str, note: str = "", drawn: set[str] | None = None) -> str:
    """report.md: the headline, the compact table, the charts (those in ``drawn``, by file
    name; None: all), then every column."""
    images = (
        "\n\n".join(
            f"![{title}]({file})\n\n*{title}*: {what}."
            for file, (title, _, what) in CHARTS.items()
            if drawn is None or file in drawn
        )
        or "No chart: no point has a usable result."
    )
    return (
        f"# Sweep report: {name}\n\n{headline(rows)}\n\n{compact(rows)}\n\n{baseline_rule()}{note}\n\n"
        f"{speed_notes(rows)}\n\n"
        f"## Charts\n\n{images}\n\n## Every column\n\n{markdown(rows)}\n"
    )
