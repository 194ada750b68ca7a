"""The plan as a person reads it (``plan.format=table`` or ``md``) or a program does (``csv``,
``json``): the same columns in each.

The header says what was planned (model preset, parameters, sequence length, precision,
optimizer, per-rank batch, device budget) and how (the method, said once); the table one row
per strategy, lever and world size, the peak broken down as the report breaks it down.

In a terminal (``plan.format=table``, ``plan.columns=short``, the default) every line fits
:data:`WIDTH` characters: the columns are kept in the order of :data:`PRIORITY` while they fit,
under short headings (:data:`SHORT`), and the line under the table names those left out; the
prose lines are wrapped. ``plan.columns=all`` and the other formats hold every column.
"""

from __future__ import annotations

import csv
import io
import json
import textwrap
from typing import Any

from omegaconf import OmegaConf
from tabulate import tabulate

from sharded_exp.config import PlanConfig
from sharded_exp.output import TERMINAL_WIDTH as WIDTH
from sharded_exp.precision import Precision
from sharded_exp.vocabulary.memory import HEADINGS, PARTS
from sharded_exp.vocabulary.memory import MEANINGS as MEMORY_MEANINGS

MEANINGS = {
    **MEMORY_MEANINGS,
    "peak": "the largest rank's peak",
    "mean": "the mean over ranks",
    "host": "host memory (CPU offload): the fullest rank's, as torch pins it (power-of-two blocks)",
    "host_node": "host memory of the fullest node (CPU offload): its ranks' together; fits holds it against the node's",
    "allocated": "the largest rank's peak as torch's CUDA allocator counts it (rounded blocks; CPU: the peak)",
    "reserved": "the largest rank's peak reserved by torch's CUDA caching allocator (its cached segments)",
    "device_total": "reserved + the CUDA context: what nvidia-smi shows; fits compares it with the device",
}
"""What each column holds, by heading: the parts' (:mod:`sharded_exp.vocabulary.memory`) and the totals'."""
SPEED = ("step_time_s", "exposed_comm_s", "tokens_per_s_per_device", "mfu_pct")
"""The speed columns (:mod:`sharded_exp.plan.speed`), headed by their JSON keys in every format."""
SPEED_FORMATS = {"step_time_s": ".4g", "exposed_comm_s": ".3g", "tokens_per_s_per_device": ".4g", "mfu_pct": ".1f"}
COLUMNS = ("strategy", "levers", "ranks", *(HEADINGS.get(p, p) for p in PARTS), "peak", "mean", "host", "host_node",
           "allocated", "reserved", "device_total", "fits", *SPEED)  # fmt: skip
"""Every format's columns, in order."""


SHORT = {"optim state": "optim", "optim step": "opt_step", "gathered": "gather", "buckets": "bucket",
         "activations": "activ", "temporaries": "temps", "workspace": "wkspace", "allocated": "alloc",
         "reserved": "resrvd", "device_total": "device", "step_time_s": "step_s", "exposed_comm_s": "comm_s",
         "tokens_per_s_per_device": "tok/s/dev", "mfu_pct": "mfu%"}  # fmt: skip
"""The short table's headings where they differ from the full ones (docs/guide/planner.md
lists them)."""
PRIORITY = ("strategy", "ranks", "levers", "method", "peak", "fits", "device_total", "host_node", "params", "grads", "optim state",
            "gathered", "buckets", "activations", "step_time_s", "mfu_pct", "temporaries", "mean", "optim step",
            "comm", "other", "workspace", "tokens_per_s_per_device", "exposed_comm_s", "host", "allocated",
            "reserved")  # fmt: skip
"""The short table's columns, most telling first: what a plan is read for (the peak, whether
it fits and the figure fits compares on CUDA, how the largest parts shrink with the strategy,
the step time) before the rest."""
READ_WITH = {"mfu_pct": "step_time_s", "tokens_per_s_per_device": "step_time_s", "exposed_comm_s": "step_time_s"}
"""A short table shows these columns only beside the one they are read with (MFU and tokens/s
are worked out from the step time; the exposed communication is a part of it)."""
TEXT = ("strategy", "levers", "fits")
"""Left-aligned columns (the others are numbers, right-aligned)."""


def cells(row: dict[str, Any], scale: float) -> list[Any]:
    """One row's values under :data:`COLUMNS` (memory times ``scale`` from GiB; None: none)."""
    mib = lambda v: None if v is None else v * scale  # noqa: E731
    fits = None if row["fits"] is None else ("yes" if row["fits"] else "no")
    return [row["strategy"], row.get("levers", "none"), row["world_size"],
            *(mib(row.get(f"{k}_gib")) for k in PARTS), mib(row["total_gib"]), mib(row.get("mean_gib")),
            mib(row.get("host_gib")), mib(row.get("host_node_gib")), mib(row.get("allocated_gib")), mib(row.get("reserved_gib")),
            mib(row.get("device_total_gib")), fits, *(row.get(k) for k in SPEED)]  # fmt: skip


def _unit(rows) -> tuple[str, float]:
    big = max((r["total_gib"] or 0 for r in rows), default=0) >= 1
    return ("GiB", 1.0) if big else ("MiB", 1024.0)


def header(cfg: PlanConfig, params: int, preset: str, faked: str, speed: str = "") -> list[str]:
    """What was planned, in two lines (three with the speed columns' machine, ``speed``)."""
    count = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params:,}"
    what = (f"raw parameter count {count} params in {cfg.plan.units} units" if cfg.plan.params is not None
            else f"model={preset} ({count} params)")  # fmt: skip
    seq = OmegaConf.select(cfg.model, "seq_len", default=None) if cfg.plan.params is None else None
    return [
        f"plan: {what}" + (f", sequence {seq}" if seq else "") + f", precision {Precision.of(cfg)}, optimizer "
        f"{cfg.optimizer.name}, batch {cfg.trainer.batch_size} per rank, device budget "
        f"{cfg.plan.device_memory_gib:g} GiB",
        f"device: {faked}",
        *([speed] if speed else []),
    ]


def methods(rows) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def shown(rows) -> list[str]:
    """The columns this plan shows: every column, less the parts (and host memory) no row
    holds anything in (a 7B DDP plan has no gathered parameters): the same in every format."""
    empty = lambda i: all(not v for v in (cells(r, 1.0)[i] for r in rows))  # noqa: E731
    optional = {HEADINGS.get(p, p) for p in PARTS} | {"host", "host_node", "reserved", "device_total"}
    return [c for i, c in enumerate(COLUMNS) if c not in optional or not empty(i)]


def _body(rows, scale: float) -> tuple[list[str], list[list[Any]]]:
    """Column headings and rows, with a ``method`` column only where the rows' methods differ."""
    found = methods(rows)
    head = shown(rows)
    index = [COLUMNS.index(c) for c in head]
    body = [[line[i] for i in index] for line in (cells(r, scale) for r in rows)]
    if len(found) > 1:
        head.append("method")
        for line, r in zip(body, rows):
            line.append(found.index(r["method"]) + 1)
    return head, body


def _strings(head: list[str], body: list[list[Any]]) -> list[list[str]]:
    """Each cell as the tables print it: memory with two decimals, the speed columns in their
    own format, none as ``-``."""
    formats = [SPEED_FORMATS.get(c, ".2f") for c in head]
    return [["-" if v is None else format(v, f) if isinstance(v, float) else str(v) for v, f in zip(line, formats)]
            for line in body]  # fmt: skip


def short_table(head: list[str], body: list[list[Any]], width: int = WIDTH) -> tuple[list[str], list[str]]:
    """The table's lines within ``width`` characters, and the columns left out: columns are
    taken in :data:`PRIORITY` order while the table still fits (one read with another only
    beside it: :data:`READ_WITH`), shown in their own order under :data:`SHORT` headings. The
    levers column is left out when every row has none."""
    strings = _strings(head, body)
    heading = {c: SHORT.get(c, c) for c in head}
    widths = {c: max(len(heading[c]), *(len(line[i]) for line in strings)) for i, c in enumerate(head)}
    wanted = [
        c for c in PRIORITY if c in head and not (c == "levers" and all(r == ["none"] for r in _column(head, body, c)))
    ]
    kept: list[str] = []
    for c in wanted:
        basis = READ_WITH.get(c)
        if basis in wanted and basis not in kept:
            continue  # MFU without the step time it is worked out from: neither shown
        if sum(widths[k] for k in [*kept, c]) + 2 * len(kept) <= width:
            kept.append(c)
    shown_columns = [c for c in head if c in kept]
    at = [head.index(c) for c in shown_columns]
    align = lambda c, v: v.ljust(widths[c]) if c in TEXT else v.rjust(widths[c])  # noqa: E731
    lines = ["  ".join(align(c, heading[c]) for c in shown_columns).rstrip(),
             "  ".join("-" * widths[c] for c in shown_columns)]  # fmt: skip
    lines += ["  ".join(align(c, line[i]) for c, i in zip(shown_columns, at)).rstrip() for line in strings]
    return lines, [c for c in head if c not in kept and c in wanted]


def _column(head: list[str], body: list[list[Any]], name: str) -> list[list[Any]]:
    i = head.index(name)
    return [[line[i]] for line in body]


def _wrapped(lines: list[str], width: int = WIDTH) -> list[str]:
    """Prose lines wrapped at ``width`` (continuations indented two spaces); a URL or another
    word longer than the width stays whole."""
    out = []
    for line in lines:
        out += textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False) or [
            ""
        ]
    return out


def text(
    rows,
    found,
    cfg: PlanConfig,
    params: int,
    preset: str,
    faked: str,
    markdown: bool = False,
    speed: str = "",
    columns: str = "all",
) -> str:
    """``plan.format=table`` (aligned columns) or ``md`` (a GitHub Markdown table).
    ``columns="short"`` (a table only): within :data:`WIDTH` characters a line
    (:func:`short_table`)."""
    unit, scale = _unit(rows)
    head, body = _body(rows, scale)
    if columns == "short" and not markdown:
        return _short_text(rows, found, cfg, params, preset, faked, speed, unit, scale, head, body)
    kinds = methods(rows)
    lines = header(cfg, params, preset, faked, speed)
    if len(kinds) == 1:
        lines.append(f"method: {kinds[0]}")
    else:
        lines += [f"method {i}: {m}" for i, m in enumerate(kinds, 1)]
    lines += allocator_lines(rows) + host_lines(rows)
    lines.append(f"{unit} per rank at the peak; - : not applicable")
    if markdown:
        lines = [f"{line}  " for line in lines]  # Markdown line breaks
    lines.append("")
    formats = [SPEED_FORMATS.get(c, ".2f") for c in head]
    lines.append(tabulate(body, headers=head, tablefmt="github" if markdown else "simple", floatfmt=formats,
                          missingval="-"))  # fmt: skip
    notes = note_lines(rows)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines + _extras(rows, found, cfg, unit, scale))


def note_lines(rows) -> list[str]:
    """One ``note:`` line per strategy (with its levers) and note, in the table's order, naming
    the world sizes whose rows it belongs to: ``note: ddp x8, x64: ...``; a row whose speed was
    not predicted says why (its ``speed_note``)."""
    found: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        levers = r.get("levers", "none")
        label = r["strategy"] if levers in (None, "none") else f"{r['strategy']} + {levers}"
        speed = r.get("speed_note")
        for note in (r["note"], speed and f"speed not predicted: {speed}"):
            if note:
                sizes = found.setdefault((label, note), [])
                sizes += [] if f"x{r['world_size']}" in sizes else [f"x{r['world_size']}"]
    return [f"note: {label} {', '.join(sizes)}: {note}" for (label, note), sizes in found.items()]


def _short_text(rows, found, cfg, params, preset, faked, speed, unit, scale, head, body) -> str:
    """The default terminal table: :func:`text`'s lines, each within :data:`WIDTH` characters
    (a found command, to be pasted whole, excepted)."""
    kinds = methods(rows)
    lines = header(cfg, params, preset, faked, speed)
    lines += [f"method: {kinds[0]}"] if len(kinds) == 1 else [f"method {i}: {m}" for i, m in enumerate(kinds, 1)]
    lines += allocator_lines(rows) + host_lines(rows)
    lines.append(f"{unit} per rank at the peak; - : not applicable")
    table_lines, left_out = short_table(head, body)
    lines = _wrapped(lines) + [""] + table_lines
    if left_out:
        lines += _wrapped([f"not shown here: {', '.join(left_out)} (plan.columns=all shows every column)"])
    notes = note_lines(rows)
    if notes:
        lines += ["", *_wrapped(notes)]
    for extra in _extras(rows, found, cfg, unit, scale):
        for line in extra.split("\n"):
            lines += [line] if line.startswith("    sharded-exp") else _wrapped([line])  # a command stays whole
    return "\n".join(lines)


def _extras(rows, found, cfg: PlanConfig, unit: str, scale: float) -> list[str]:
    from sharded_exp.plan.points import cheapest, lever_combos  # lazy: points imports torch; a table needs none

    lines = []
    if cfg.plan.params is None and (len(lever_combos(cfg)) > 1 or any(r.get("levers", "none") != "none" for r in rows)):
        for best in cheapest(rows):
            label = best["strategy"] + ("" if best["levers"] == "none" else f" + {best['levers']}")
            cost = f"; {best['cost']}" if best.get("cost") else ""
            lines.append(f"cheapest that fits at {best['world_size']} ranks: {label} ({best['total_gib'] * scale:.2f} "
                         f"{unit}{cost})")  # fmt: skip
    if found and str(cfg.plan.find) == "fastest":
        lines.append(f"\nfastest that fits {cfg.plan.device_memory_gib:g} GiB (global batch fixed; grad_accum makes up "
                     "the rest):")  # fmt: skip
        lines += [_fastest_line(f, unit, scale) for f in found]
    elif found:
        find = str(cfg.plan.find)
        label = {
            "batch_size": "largest batch per rank",
            "depth": f"largest depth at d_model={cfg.model.get('d_model')}",
        }
        lines.append(f"\n{label[find]} that fits {cfg.plan.device_memory_gib:g} GiB:")
        lines += [f"  {f['strategy']}{'' if f.get('levers', 'none') == 'none' else ' + ' + f['levers']} "
                  f"x{f['world_size']}: {f['value']} ({f['note']})" for f in found]  # fmt: skip
    return lines


def allocator_lines(rows) -> list[str]:
    """What the allocator columns were modelled with (said once): the allocator setting and
    the CUDA context's figure and source. Nothing on CPU (no caching allocator: no reserved
    column, allocated is the tensors' bytes, fits compares the peak) or for a raw count."""
    modelled = [r for r in rows if r.get("context_source")]
    if not modelled:
        return []
    first = modelled[0]
    context = f"CUDA context {first['context_gib'] * 1024:.0f} MiB: {first['context_source']}"
    if all(r.get("reserved_gib") is None for r in modelled):  # backend:cudaMallocAsync (points.unmodelled_allocator)
        return [
            f"allocator: {first['alloc_conf']}: the driver's pool, not torch's caching allocator: not modelled, no "
            f"reserved figure; fits compares the tensors' peak + {context} (a floor of what nvidia-smi shows)"
        ]
    settings = f"with {first['alloc_conf']}" if first["alloc_conf"] else "with torch's default settings"
    return [
        f"allocator: torch's CUDA caching allocator modelled {settings}; fits compares device_total (reserved + {context})"
    ]


def host_lines(rows) -> list[str]:
    """What offloaded rows' host memory is held against (said once): the node's memory and
    where it comes from. Nothing where no row offloads."""
    offloaded = [r for r in rows if r.get("host_node_gib") is not None]
    if not offloaded:
        return []
    budget, basis = offloaded[0].get("host_memory_gib"), offloaded[0].get("host_memory_basis")
    held = f"fits also holds host_node against {budget:,g} GiB ({basis})" if budget else f"host unchecked: {basis}"
    return [f"host: CPU offload's pinned shards rounded up to powers of two (torch's CachingHostAllocator); {held}"]


def _fastest_line(f: dict[str, Any], unit: str, scale: float) -> str:
    if f.get("command") is None:
        return f"  x{f['world_size']}: {f['note']}"
    label = f["strategy"] + ("" if f.get("levers", "none") == "none" else f" + {f['levers']}")
    replicate = f", replicate {f['replicate']}" if f.get("replicate", 1) > 1 else ""
    tokens = f", {f['tokens_per_s_per_device']:.4g} tokens/s/device" if f.get("tokens_per_s_per_device") else ""
    mfu = f", MFU {f['mfu_pct']:.1f}%" if f.get("mfu_pct") is not None else ""
    return (f"  x{f['world_size']}: {label}, batch {f['batch_size']} x grad_accum {f['grad_accum']}{replicate}: "
            f"{f['step_time_s']:.4g} s/step{tokens}{mfu}, peak {f['total_gib'] * scale:.2f} {unit} ({f['note']})\n"
            f"    {f['command']}")  # fmt: skip


def csv_text(rows) -> str:
    """``plan.format=csv``: the table's columns, memory in GiB, one line per row; a file has no
    header lines to say them in, so the method (where the rows' differ) is its text, and each
    row's note (and why it has no speed, where it has none) is a last column."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    head, body = _body(rows, 1.0)
    writer.writerow([*head, "note"])
    for r, line in zip(rows, body):
        line = line[:-1] + [r["method"]] if head[-1] == "method" else line
        speed = r.get("speed_note")
        note = "; ".join(n for n in (r["note"], speed and f"speed not predicted: {speed}") if n)
        writer.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in [*line, note]])
    return out.getvalue().rstrip("\n")


def json_text(doc: dict[str, Any]) -> str:
    """``plan.format=json``: the rows (every column, and more: ``<part>_gib``, ``phases_gib``,
    the note), the columns' names, what was planned."""
    return json.dumps(doc, indent=2)


def column_keys(rows) -> dict[str, str]:
    """Each shown column's key in a JSON row, the method's among them where the rows' differ
    (a table's last column; a CSV's last but its note)."""
    keys = {"strategy": "strategy", "levers": "levers", "ranks": "world_size"}
    keys |= {HEADINGS.get(p, p): f"{p}_gib" for p in PARTS}
    keys |= {"peak": "total_gib", "mean": "mean_gib", "host": "host_gib", "host_node": "host_node_gib", "fits": "fits"}
    keys |= {k: k for k in SPEED}
    keys |= {"allocated": "allocated_gib", "reserved": "reserved_gib", "device_total": "device_total_gib"}
    method = {"method": "method"} if len(methods(rows)) > 1 else {}
    return {c: keys[c] for c in shown(rows)} | method
