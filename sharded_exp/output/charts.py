"""What every chart of the project shares, and the planner's chart, drawn with matplotlib
(Agg, no display): the figure format, a figure as a chart prints it, the world-size axis,
one colour per series, saving.

The sweep report's charts are in :mod:`sharded_exp.report.figures`; the planner's chart
(:func:`plan_chart`) is here, beside the helpers both use.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # lazy: matplotlib takes over a second to import; only a drawn chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: (as above), after the backend is chosen

    return plt


def num(value: float | None) -> str:
    """A figure as a chart or a table prints it: two decimals (3.66, not 4), three
    significant digits below 1 (0.0866), thousands separated from 100 on (6,184)."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def world_axis(ax, world_sizes: list[int]) -> dict[int, int]:
    """World sizes as evenly spaced positions (1, 2, 4, 64 read as a sequence), labelled in words."""
    ax.set_xticks(range(len(world_sizes)), [ranks(w) for w in world_sizes])
    ax.set_xlim(-0.5, len(world_sizes) - 0.5)
    ax.set_xlabel("world size")
    return {w: i for i, w in enumerate(world_sizes)}


def _colors(n: int):
    plt = pyplot()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def palette(labels) -> dict[str, Any]:
    """One colour per series, the same in every chart of a report."""
    labels = list(dict.fromkeys(labels))
    return dict(zip(labels, _colors(len(labels))))


def save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# ------------------------------------------------------------------------ the planner's chart
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _end_labels(ax, fig, x: float, ends: dict[str, list[str]], gap: float = 0.04) -> None:
    """Label each line's last point ("77.16 (oss)") at the right, pushed apart where two
    lines end close together (at least ``gap`` of the axes' height between labels)."""
    lo, hi = (math.log(v) for v in ax.get_ylim())
    height_pt = fig.get_figheight() * ax.get_position().height * 72
    spots = sorted(((math.log(float(v.replace(",", ""))) - lo) / (hi - lo), v) for v in ends)
    placed: list[float] = []
    for frac, value in spots:
        at = max(frac, placed[-1] + gap) if placed else frac
        placed.append(at)
        ax.annotate(
            f"{value} ({', '.join(ends[value])})",
            (x, float(value.replace(",", ""))),
            textcoords="offset points",
            xytext=(8, (at - frac) * height_pt),
            fontsize=7,
            va="center",
        )


def _strategy_axis(ax, labels: list[str], world_size: int) -> dict[str, int]:
    """A single world size's x axis: one slot per line, named under it, so that no two
    markers share a place and each label can sit on its own marker."""
    long = max((len(label) for label in labels), default=0) > 12
    ax.set_xticks(range(len(labels)), labels, fontsize=8, **({"rotation": 25, "ha": "right"} if long else {}))
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_xlabel(f"strategy, at {ranks(world_size)}")
    return {label: i for i, label in enumerate(labels)}


def plan_chart(rows: list[dict[str, Any]], budget_gib: float, title: str):
    """Memory per rank at the peak vs world size, a line per strategy (and lever
    combination; each its own marker, so lines that coincide stay visible), the device's
    memory as a line; the points that fit are filled, the last world size labelled.

    At a single world size every line is one point at the same x: their labels, pushed apart
    to stay legible, ended far from their markers. There each line gets its own slot on the
    x axis instead, and its figure sits on its marker."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5))
    world_sizes = sorted({r["world_size"] for r in rows})
    big = max((r["total_gib"] or 0 for r in rows), default=0) >= 1 or budget_gib >= 1
    unit, scale = ("GiB", 1.0) if big else ("MiB", 1024.0)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = r["strategy"] + ("" if r.get("levers", "none") == "none" else f" + {r['levers']}")
        groups.setdefault(label, []).append(r)
    single = len(world_sizes) == 1
    if single:
        slots = _strategy_axis(ax, list(groups), world_sizes[0])
    else:
        xpos = world_axis(ax, world_sizes)
    colors = palette(groups)
    ends: dict[str, list[str]] = {}  # the last world size's figure -> the lines that end there
    for i, (label, members) in enumerate(groups.items()):
        color, marker = colors[label], MARKERS[i % len(MARKERS)]
        members = [r for r in sorted(members, key=lambda r: r["world_size"]) if r["total_gib"] is not None]
        xs = [slots[label] if single else xpos[r["world_size"]] for r in members]
        ys = [r["total_gib"] * scale for r in members]
        ax.plot(xs, ys, "-", color=color, label=label, marker=marker, markerfacecolor="white")
        fit = [(x, y) for x, y, r in zip(xs, ys, members) if r["fits"]]
        ax.plot([p[0] for p in fit], [p[1] for p in fit], linestyle="none", marker=marker, color=color)
        if single:
            for x, y in zip(xs, ys):
                ax.annotate(num(y), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", va="bottom",
                            fontsize=7, color=color)  # fmt: skip
        elif members and members[-1]["world_size"] == world_sizes[-1]:
            ends.setdefault(num(ys[-1]), []).append(label)
    ax.axhline(budget_gib * scale, color="crimson", linestyle=":", linewidth=1.5)
    ax.set_yscale("log")
    if not single:
        _end_labels(ax, fig, len(world_sizes) - 1, ends)
        ax.set_xlim(-0.5, len(world_sizes) + 0.6)  # room for the labels at the right
    ax.annotate(
        f"device memory {budget_gib * scale:g} {unit}",
        (0, budget_gib * scale),
        xycoords=("axes fraction", "data"),
        xytext=(4, -11),
        textcoords="offset points",
        fontsize=8,
        color="crimson",
    )

    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(lambda v, _: f"{v:g}")  # 60, not 6 x 10^1 (a function is wrapped in a FuncFormatter)
    ax.set_ylabel(f"peak per rank ({unit}, log scale)")
    ax.set_title(title, fontsize=10)
    # lower left: clear of the labels at the right; one world size has none there, so wherever is free
    ax.legend(
        fontsize=8, title="filled: fits; hollow: does not", title_fontsize=8, loc="best" if single else "lower left"
    )
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
