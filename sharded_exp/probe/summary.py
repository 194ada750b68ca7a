"""The probe's answer in the terminal: a few lines rank 0 prints when it has written
``result.json``, so a user sees what was found without opening the file.

    sharded_exp probe: ddp, 2 ranks (cpu), 35 steps, ok
      peak per rank:  2.47 MiB largest, 2.45 mean (rank 0 2.47, rank 1 2.43)
      rank 0's split: params 0.55, grads 0.55, optimizer 1.10, activations 0.54, temporaries 0.03
      predicted:      1.94 MiB, 21.5% too low; params 0.55, grads 0.55, optimizer 1.10, activations 0.004
      speed:          12.3 ms a step (median of 28), 1,234 samples/s
      result:         outputs/probe/2026-12-04_18-00-00/result.json

Pure: it reads the written result (``Result.as_written()``) and nothing else. Category names
are ours (:data:`~sharded_exp.vocabulary.memory.TORCH_CATEGORIES`), whichever names the
tracker filed them under.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

from sharded_exp.output.charts import num, ranks
from sharded_exp.vocabulary.memory import TORCH_CATEGORIES

LISTED_RANKS = 8
"""Up to this many ranks each rank's peak is listed; above, the largest and the mean only."""
WIDTH = 100
"""Columns a line fits in (a longer split wraps under itself)."""


def split_text(breakdown: dict[str, float] | None) -> str:
    """``params 0.55, grads 0.55, optimizer 1.10`` (MiB), in the breakdown's order, categories
    that are one of ours summed, the empty ones left out."""
    parts: dict[str, float] = {}
    for name, mib in (breakdown or {}).items():
        if mib:
            ours = TORCH_CATEGORIES.get(name, name)  # torch's tracker names as ours
            parts[ours] = parts.get(ours, 0.0) + mib
    return ", ".join(f"{name} {num(mib)}" for name, mib in parts.items() if round(mib, 3))


def error_text(error: float) -> str:
    """``21.5% too low``; under 0.05% either way, ``as measured``."""
    if abs(error) < 0.0005:
        return "as measured (within 0.05%)"
    return f"{abs(error):.1%} {'too high' if error > 0 else 'too low'}"


def _line(label: str, text: str, wrap: bool = True) -> str:
    """``label: text``, wrapped at :data:`WIDTH` (``wrap=False``: a path, kept whole to be copied)."""
    head = f"  {label + ':':<16}"
    if not wrap:
        return head + text
    return textwrap.fill(text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head), break_long_words=False)


def summary(result: dict[str, Any]) -> str:
    """The lines (see the module docstring) for a written result.json's dict."""
    memory = result.get("memory") or {}
    per_rank = memory.get("per_rank") or []
    world = int(result.get("world_size") or len(per_rank) or 1)
    device = (result.get("device") or {}).get("type") or "?"
    lines = [
        f"sharded_exp probe: {result.get('strategy')}, {ranks(world)} ({device}), {result.get('steps')} steps, "
        f"{result.get('status')}" + (f": {str(result['error']).splitlines()[0][:200]}" if result.get("error") else "")
    ]
    largest = memory.get("peak_allocated_mib_max")
    if largest is None:
        lines.append(_line("peak per rank", f"not measured ({memory.get('peak_error') or 'no figure'})"))
    else:
        measured = [r for r in per_rank if r.get("peak_allocated_mib") is not None]
        if world == 1:
            lines.append(_line("peak", f"{num(largest)} MiB"))
        else:
            text = f"{num(largest)} MiB largest, {num(memory.get('peak_allocated_mib_mean'))} mean"
            if 1 < len(measured) <= LISTED_RANKS:
                text += " (" + ", ".join(f"rank {r['rank']} {num(r['peak_allocated_mib'])}" for r in measured) + ")"
            lines.append(_line("peak per rank", text))
        top = max(measured, key=lambda r: r["peak_allocated_mib"], default={})
        split = split_text(top.get("peak_breakdown_mib"))
        if split:
            lines.append(_line("split" if world == 1 else f"rank {top['rank']}'s split", split + " MiB"))
    prediction = memory.get("peak_prediction") or {}
    predicted, error = memory.get("predicted_peak_mib_max"), memory.get("peak_rel_error_max")
    if predicted is None:
        lines.append(_line("predicted", f"none ({prediction.get('error') or 'no prediction'})"))
    else:
        text = f"{num(predicted)} MiB"
        if error is not None:
            text += f", {error_text(error)}" + (" (the largest error over ranks)" if world > 1 else "")
        split = split_text(prediction.get("breakdown_mib"))
        lines.append(_line("predicted", text + (f"; {split}" if split else "")))
    speed = result.get("throughput") or {}
    if speed.get("step_time_s_median"):
        text = f"{speed['step_time_s_median'] * 1000:.3g} ms a step (median of {speed.get('timed_steps')})"
        if speed.get("samples_per_s"):
            text += f", {num(speed['samples_per_s'])} samples/s"
        lines.append(_line("speed", text))
    lines.append(_line("result", os.path.join(str(result.get("output_dir")), "result.json"), wrap=False))
    return "\n".join(lines)
