"""The sweep report's charts, drawn with matplotlib (Agg, no display): memory, throughput,
what each peak holds, and predicted against measured (:data:`CHARTS`).

Every function takes the report's rows (:func:`sharded_exp.report.rows.build_rows`), returns
the matplotlib Figure (tests read its artists) and draws nothing as a value it is not: a
point that ran out of memory, failed or diverged has no measured figure, so it is a labelled
marker ("OOM") at the memory limit, never a bar or a line at zero. What the planner's chart
draws too (the figure format, the world-size axis, the palette) is in
:mod:`sharded_exp.output.charts`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from sharded_exp.output.charts import num, palette, pyplot, ranks, save, world_axis
from sharded_exp.report.rows import series_keys, series_label, swept_of
from sharded_exp.report.statistics import BAND
from sharded_exp.vocabulary.memory import (
    CHART_COLORS,
    CHART_PARTS,
    CHART_REST,
    MEASURED_CHART_PARTS,
    PREDICTED_CHART_PARTS,
)

STATUS_LABEL = {"oom": "OOM", "failed": "failed", "diverged": "diverged", "stopped": "stopped"}
"""How a point that has no measured figure is labelled in a chart."""


def _series(rows, keys) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(series_label(row, keys), []).append(row)
    return out


def _legend_extra(ax, handles: list) -> None:
    """The legend: the series drawn, then ``handles`` (each only if it stands for something drawn)."""
    found, labels = ax.get_legend_handles_labels()
    if found or handles:
        ax.legend(found + handles, labels + [h.get_label() for h in handles], fontsize=8, loc="best")


MAX_LABELS = 24
"""More point labels than this on one chart are left out (the tables hold every figure)."""


def place_labels(ax, texts: list) -> None:
    """Move the points' labels off the points and apart so that none overlaps another or a
    point (adjustText; a thin line leads back to its point); beyond :data:`MAX_LABELS` they
    are removed instead. Each text starts at its point."""
    if len(texts) > MAX_LABELS:
        for text in texts:
            text.remove()
        return
    if texts:
        from adjustText import adjust_text  # lazy: it imports matplotlib

        xs, ys = [t.get_position()[0] for t in texts], [t.get_position()[1] for t in texts]
        adjust_text(
            texts,
            x=xs,
            y=ys,
            ax=ax,
            expand=(1.4, 1.8),
            ensure_inside_axes=True,
            arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.5},
        )


def context(rows: list[dict[str, Any]]) -> str:
    """What every point of a chart shares or spans, for its title: model, precision, device
    and per-rank batch (``model mlp, precision 16/32, cpu, batch 8/rank``)."""

    def values(key: str) -> str:
        found = sorted({str(r.get(key)) for r in rows if r.get(key) is not None})
        return "/".join(found) if found else "?"

    return f"model {values('model')}, precision {values('precision')}, {values('device')}, batch {values('batch_size')}/rank"


def _world_size_axes(rows: list[dict[str, Any]], swept: list[str]):
    """What the two charts against world size share: the points that have one, their
    series, and a figure whose x axis is the world sizes."""
    rows = [r for r in rows if r["world_size"]]
    keys = series_keys(rows, swept)
    fig, ax = pyplot().subplots(figsize=(8, 5))
    return rows, keys, _series(rows, keys), fig, ax, world_axis(ax, sorted({r["world_size"] for r in rows}))


def memory_chart(rows: list[dict[str, Any]], swept: list[str]):
    """(1) Peak per rank (max over ranks) vs world size: a solid line per strategy (and
    per swept setting) through the measured peaks, the prediction dashed in the same colour
    (drawn over the measured line where they meet), each point labelled; a point that did
    not finish is a cross labelled with its status at its measured value: where it ran out
    of memory, what was live when it crossed its budget (the limit a dotted line); else its
    measured peak; else its budget; else its prediction."""
    from matplotlib.lines import Line2D  # lazy: matplotlib

    rows, keys, groups, fig, ax, xpos = _world_size_axes(rows, swept)
    limits = sorted({r["memory_limit_mib"] for r in rows if r.get("memory_limit_mib")})
    top = max(
        [v for r in rows for v in (r["peak_allocated_mib_max"], r["predicted_peak_mib_max"], r.get("oom_at_mib")) if v]
        + limits,
        default=1.0,
    )
    colors = palette(groups)
    texts, drew_prediction, drew_miss = [], False, False
    for i, (label, members) in enumerate(groups.items()):
        shift = (i - (len(groups) - 1) / 2) * 0.08  # side by side where two lines meet
        line = _MemoryLine(ax, label, colors[label], shift, xpos, texts)
        drew_prediction |= line.draw(sorted(members, key=lambda r: r["world_size"]), top)
        drew_miss |= line.missed
    _draw_limits(ax, limits)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("peak per rank (MiB, max over ranks)")
    ax.set_title(f"Peak memory per rank: measured (solid), predicted (dashed)\n{context(rows)}", fontsize=10)
    extra = [Line2D([], [], color="gray", linestyle="--", label="predicted")] if drew_prediction else []
    if drew_miss:
        extra.append(
            Line2D(
                [],
                [],
                color="gray",
                marker="X",
                markeredgecolor="black",
                linestyle="none",
                label="did not finish: at its value when it ran out",
            )
        )
    _legend_extra(ax, extra)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    place_labels(ax, texts)
    return fig


class _MemoryLine:
    """One group's line of :func:`memory_chart`: measured, predicted and the points that did not finish."""

    def __init__(self, ax, label: str, color, shift: float, xpos: dict, texts: list):
        self.ax, self.label, self.color, self.shift, self.xpos, self.texts = ax, label, color, shift, xpos, texts
        self.missed = False

    def draw(self, members: list[dict[str, Any]], top: float) -> bool:
        """Draw the group's points; True when it drew a prediction."""
        ax, color, shift, xpos = self.ax, self.color, self.shift, self.xpos
        ok = [r for r in members if r["status"] == "ok" and r["peak_allocated_mib_max"] is not None]
        xs = [xpos[r["world_size"]] + shift for r in ok]
        ys = [r["peak_allocated_mib_max"] for r in ok]
        if ok:
            ax.plot(xs, ys, "-o", color=color, label=self.label, zorder=2)
        for x, y in zip(xs, ys):
            self.texts.append(ax.text(x, y, num(y), fontsize=7, color=color))
        predicted = [r for r in members if r["predicted_peak_mib_max"] is not None]
        if predicted:
            ax.plot(
                [xpos[r["world_size"]] + shift for r in predicted],
                [r["predicted_peak_mib_max"] for r in predicted],
                "--",
                color=color,
                alpha=0.9,
                marker=".",
                markersize=5,
                linewidth=1.6,
                zorder=3,
                **({} if ok else {"label": f"{self.label} (predicted only)"}),
            )
        for r in members:
            if r not in ok:
                self._missed(r, top)
        return bool(predicted)

    def _missed(self, r: dict[str, Any], top: float) -> None:
        self.missed = True
        # its value when it ran out; else its measured peak; else (no figure: a CUDA OOM) its
        # budget, which it crossed; else its prediction
        y = (
            r.get("oom_at_mib")
            or r["peak_allocated_mib_max"]
            or r.get("memory_limit_mib")
            or r["predicted_peak_mib_max"]
            or top
        )
        x = self.xpos[r["world_size"]] + self.shift
        self.ax.plot(
            [x], [y], marker="X", markersize=10, color=self.color, markeredgecolor="black", linestyle="none", zorder=4
        )
        status = STATUS_LABEL.get(r["status"], r["status"])
        label = f"{status} {num(y)}" if r.get("oom_at_mib") else status
        self.texts.append(self.ax.text(x, y, label, fontsize=8, fontweight="bold", color=self.color))


def _draw_limits(ax, limits: list[float]) -> None:
    """Each memory budget as a dotted line, named at the right edge."""
    for limit in limits:
        ax.axhline(limit, color="crimson", linestyle=":", linewidth=1.2)
        ax.annotate(
            f"memory limit {limit:g} MiB",
            (1, limit),
            xycoords=("axes fraction", "data"),
            xytext=(-4, -11),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="crimson",
        )


def throughput_chart(rows: list[dict[str, Any]], swept: list[str]):
    """(2) Samples per second (all ranks, median step) vs world size, with the median's 95%
    interval as an error bar, a line per strategy (and swept setting); the points without
    a throughput are named in a box of their own, not drawn at a height."""
    rows, keys, groups, fig, ax, xpos = _world_size_axes(rows, swept)
    missing, texts = [], []
    colors = palette(groups)
    for i, (label, members) in enumerate(groups.items()):
        color = colors[label]
        shift = (i - (len(groups) - 1) / 2) * 0.08  # side by side where two lines meet
        members = sorted(members, key=lambda r: r["world_size"])
        ok = [r for r in members if r["status"] == "ok" and r["samples_per_s"]]
        if ok:
            xs, ys = [xpos[r["world_size"]] + shift for r in ok], [r["samples_per_s"] for r in ok]
            low = [y - (r.get("samples_per_s_ci95_low") or y) for r, y in zip(ok, ys)]
            high = [(r.get("samples_per_s_ci95_high") or y) - y for r, y in zip(ok, ys)]
            ax.errorbar(xs, ys, yerr=[low, high], fmt="-o", color=color, label=label, capsize=3)
            texts += [ax.text(x, y, num(y), fontsize=7, color=color) for x, y in zip(xs, ys)]
        missing += [
            f"{label} at {ranks(r['world_size'])}: {STATUS_LABEL.get(r['status'], r['status'])}"
            for r in members
            if r not in ok
        ]
    if missing:
        ax.text(
            0.01,
            0.99,
            "no throughput:\n" + "\n".join(missing),
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "gray", "boxstyle": "round,pad=0.3", "alpha": 0.9},
        )
    top = max(
        (
            r.get("samples_per_s_ci95_high") or r["samples_per_s"]
            for r in rows
            if r["status"] == "ok" and r["samples_per_s"]
        ),
        default=1.0,
    )
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("samples/s (all ranks, median step; bars: its 95% interval)")
    ax.set_title(f"Throughput\n{context(rows)}", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    place_labels(ax, texts)
    return fig


def measured_parts(row: dict[str, Any]) -> dict[str, float] | None:
    """The measured peak's split (CPU memory tracker) of the rank with the largest peak."""
    entries = [e for e in row.get("per_rank") or [] if e.get("peak_breakdown_mib") and e.get("peak_allocated_mib")]
    if entries:
        split = max(entries, key=lambda e: e["peak_allocated_mib"])["peak_breakdown_mib"]
    elif row.get("oom_categories"):  # a CPU point that ran out: what was live when it crossed its budget
        split = row["oom_categories"]
    else:
        return None
    out = dict.fromkeys(CHART_PARTS, 0.0)
    for key, value in split.items():
        out[MEASURED_CHART_PARTS.get(key, CHART_REST)] += value or 0.0
    return out


def predicted_parts(row: dict[str, Any]) -> dict[str, float] | None:
    """The predicted peak's split (the fake step) of the rank holding the most states."""
    breakdown = (row.get("peak_prediction") or {}).get("breakdown_mib")
    if not breakdown:
        return None
    out = dict.fromkeys(CHART_PARTS, 0.0)
    for key, value in breakdown.items():
        out[PREDICTED_CHART_PARTS.get(key, CHART_REST)] += value or 0.0
    return out


def breakdown_chart(rows: list[dict[str, Any]], swept: list[str]):
    """(3) Each point's peak split into parameters, gradients, optimizer state, communication
    buckets, activations and temporaries (:data:`CHART_PARTS`): measured (solid, where the CPU tracker split it; for a
    point that ran out of memory, what was live when it crossed its budget, marked OOM) and
    predicted (hatched) side by side."""
    from matplotlib.patches import Patch  # lazy: matplotlib

    plt = pyplot()
    rows = [r for r in rows if r["world_size"]]
    keys = series_keys(rows, swept)
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 2), 5))
    width = 0.38
    top = 0.0
    for i, row in enumerate(rows):
        for offset, parts, hatch in ((-width / 2, measured_parts(row), None), (width / 2, predicted_parts(row), "//")):
            if parts is None:
                why = STATUS_LABEL.get(row["status"], "not split") if row["status"] != "ok" else "not split"
                ax.text(
                    i + offset,
                    0.02,
                    why,
                    transform=_blend(ax),
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    fontweight="bold",
                )
                continue
            bottom = 0.0
            for part, color in zip(CHART_PARTS, CHART_COLORS):
                ax.bar(i + offset, parts[part], width, bottom=bottom, color=color, hatch=hatch, edgecolor="white")
                bottom += parts[part]
            at_oom = hatch is None and row["status"] == "oom"  # measured when the budget was crossed
            ax.annotate(
                num(bottom) + (" OOM" if at_oom else ""),
                (i + offset, bottom),
                textcoords="offset points",
                xytext=(0, 2),
                ha="center",
                fontsize=7,
                fontweight="bold" if at_oom else None,
            )
            top = max(top, bottom)
    labels = [f"{series_label(r, keys)}\n{ranks(r['world_size'])}" for r in rows]
    if (
        max((len(line) for label in labels for line in label.split("\n")), default=0) > 14
    ):  # long labels: one line, slanted
        ax.set_xticks(
            range(len(rows)),
            [label.replace("\n", ", ") for label in labels],
            fontsize=8,
            rotation=25,
            ha="right",
            rotation_mode="anchor",
        )
    else:
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(0, (top or 1.0) * 1.15)
    ax.set_ylabel("MiB at the peak (rank with the largest peak)")
    ax.set_title(
        f"What the peak holds: measured (left, solid), predicted (right, hatched)\n{context(rows)}", fontsize=10
    )
    handles = [Patch(color=c, label=p) for p, c in zip(CHART_PARTS, CHART_COLORS)]
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="predicted"))
    ax.legend(handles=handles, fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _blend(ax):
    import matplotlib.transforms as transforms  # lazy: matplotlib

    return transforms.blended_transform_factory(ax.transData, ax.transAxes)


def prediction_chart(rows: list[dict[str, Any]], swept: list[str]):
    """(4) Each rank's predicted peak against its measured one, with the band where the
    prediction is within 5%: above it the prediction was too high, below too low."""
    plt = pyplot()
    keys = series_keys([r for r in rows if r["world_size"]], swept)
    colors = palette(series_label(r, keys) for r in rows if r["world_size"])
    fig, ax = plt.subplots(figsize=(6.5, 6))
    points: dict[str, list[tuple[float, float]]] = {}
    misses: dict[str, list[tuple[float, float]]] = {}  # ran out of memory: at its value then
    for row in rows:
        if row["status"] == "oom" and row.get("oom_at_mib") and row.get("predicted_peak_mib_max"):
            misses.setdefault(series_label(row, keys), []).append((row["oom_at_mib"], row["predicted_peak_mib_max"]))
        if row["status"] != "ok":
            continue
        for e in row.get("per_rank") or []:
            if e.get("peak_allocated_mib") and e.get("predicted_peak_mib"):
                points.setdefault(series_label(row, keys), []).append(
                    (e["peak_allocated_mib"], e["predicted_peak_mib"])
                )
    values = [v for pts in (*points.values(), *misses.values()) for p in pts for v in p]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    span = [max(0.0, lo - 0.1 * (hi - lo + 1e-9) - 0.05 * hi), hi + 0.1 * (hi - lo) + 0.05 * hi]
    ax.fill_between(
        span,
        [s * (1 - BAND) for s in span],
        [s * (1 + BAND) for s in span],
        color="green",
        alpha=0.12,
        label=f"within ±{BAND:.0%}",
    )
    ax.plot(span, span, color="green", linewidth=1, label="predicted = measured")
    for label, pts in points.items():
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=colors[label], label=label, s=30, zorder=3)
    for i, (label, pts) in enumerate(misses.items()):  # larger first: equal points show as rings, none hidden
        ax.scatter(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color=colors[label],
            marker="X",
            s=max(40, 200 - 60 * i),
            zorder=4 + i,
            edgecolors="black",
            label=f"{label}: ran out (measured when it crossed its budget)",
        )
    ax.set_xlim(span)
    ax.set_ylim(span)
    ax.set_xlabel("measured peak per rank (MiB)")
    ax.set_ylabel("predicted peak per rank (MiB)")
    ax.set_title(f"Predicted vs measured peak per rank (crosses: ran out)\n{context(rows)}", fontsize=10)
    if not values:
        ax.text(0.5, 0.5, "no point ran to a measured peak", transform=ax.transAxes, ha="center")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


CHARTS = {
    "memory.png": ("Peak memory per rank vs world size", memory_chart,
                   "measured peak per rank (solid) and its prediction (dashed) per strategy; a cross labelled OOM, "
                   "failed or diverged where a point did not finish, at its value when it ran out (what was live when "
                   "it crossed its budget, the dotted line) or else its prediction"),
    "throughput.png": ("Throughput vs world size", throughput_chart,
                       "samples per second of all ranks (median step), its 95% interval as error bars; points without "
                       "a throughput are named in a box"),
    "breakdown.png": ("What each peak holds", breakdown_chart,
                      "each point's peak split into parameters, gradients, optimizer state, communication buckets, "
                      "activations and "
                      "temporaries: measured (left; CPU tracker; for a point that ran out of memory, what was live when it "
                      "crossed its budget, marked OOM) beside predicted (right, hatched; the fake step)"),
    "prediction.png": ("Predicted vs measured peak", prediction_chart,
                       f"every rank of every point that ran, and (crosses) each point that ran out of memory at its "
                       f"value when it crossed its budget; the band is ±{BAND:.0%}"),
}  # fmt: skip
"""The report's charts: file -> (title, function, what it shows)."""


def write_charts(rows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    """The four charts of :data:`CHARTS` in ``sweep_dir``, of the points that have a world
    size (an unreadable result.json has none). A chart that cannot be drawn is left out with
    a warning: the tables are written regardless."""
    rows = [r for r in rows if r.get("world_size")]
    if not rows:
        return []
    swept = swept_of(rows)
    written = []
    for name, (_, draw, _) in CHARTS.items():
        try:
            written.append(save(draw(rows, swept), Path(sweep_dir) / name))
        except Exception as exc:  # noqa: BLE001 -- a chart is a view; report.md and the CSV still hold every figure
            print(f"warning: {name} not drawn ({type(exc).__name__}: {exc})", file=sys.stderr)
    return written
