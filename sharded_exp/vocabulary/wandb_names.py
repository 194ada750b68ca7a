"""What every figure and run is called in Weights & Biases, in one place.

A figure has one name everywhere (result.json's path with ``/`` between keys, the W&B history
and summary key, ``objective=``, a workspace panel), and a run's group, id, name and tags are
derived from the same inputs wherever they are made: the job (``__main__``, the loggers), the
sweep report's run (``report.publish``) and the saved workspace (``report.workspace``). The
modules that write W&B runs read their names here; nothing here imports wandb.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from sharded_exp.vocabulary.memory import MODEL_STATES

# ------------------------------------------------------------------ runs: group, id, name, tags


def _sha1(text: str, length: int) -> str:
    """The one hash W&B names take from a path: the first ``length`` hex digits of its SHA-1."""
    return hashlib.sha1(text.encode()).hexdigest()[:length]


def wandb_group(directory: str | Path) -> str:
    """The W&B group of a run or sweep directory: its name and a short hash of its absolute
    path, so that two sweeps whose directories share a name (``a/sweep``, ``b/sweep``) never
    share a group, and the same directory always gives the same one."""
    path = os.path.abspath(directory)
    return f"{os.path.basename(path)}-{_sha1(path, 6)}"


def report_run_id(sweep_dir: str | Path) -> str:
    """The sweep report's fixed run id: one report run per sweep directory, so that reporting
    again replaces it. Hashes the resolved path (symlinks followed) to 12 digits, where
    :func:`wandb_group` hashes the absolute one to 6: ids already given stay as they were."""
    return "report-" + _sha1(str(Path(sweep_dir).resolve()), 12)


REPORT_JOB_TYPE = "report"
"""The sweep report run's job type (a job's run takes its strategy's name: :func:`job_type`)."""


def report_run_name(sweep_dir: str | Path) -> str:
    """The sweep report run's name: ``report <the sweep directory's name>``."""
    return f"report {Path(sweep_dir).name}"


def job_type(strategy: str) -> str:
    """A job's W&B job type: its strategy's name."""
    return strategy


def run_name(override_dirname: str) -> str:
    """A job's W&B run name: its overrides as Hydra joins them, ``defaults`` when none."""
    return override_dirname or "defaults"


def run_tags(
    strategy: str,
    precision: str,
    model: str,
    world_size: int,
    *,
    activation_checkpointing: str = "none",
    compile: bool = False,
    replicate: int | None = None,
    cpu_offload: bool = False,
) -> list[str]:
    """Tags that group and filter runs in the W&B UI: strategy, precision, model, world size,
    and each lever that is on (activation checkpointing, compile, HSDP, CPU offload)."""
    levers = {
        f"ac:{activation_checkpointing}": activation_checkpointing != "none",
        "compile": bool(compile),
        f"hsdp:{replicate}": (replicate or 1) > 1,
        "cpu_offload": cpu_offload,
    }
    return [f"strategy:{strategy}", f"precision:{precision}", f"model:{model}", f"world_size:{world_size}"] + [
        tag for tag, on in levers.items() if on
    ]


# ------------------------------------------------------------------ metric paths

LOSS = "loss"
STEP_TIME_S = "throughput/step_time_s"
SAMPLES_PER_S = "throughput/samples_per_s"
STEP_TIME = "throughput/step_time_s_median"
"""The measured median step time's W&B key."""
PREDICTED_STEP_TIME = "throughput/predicted_step_time_s"
"""The time model's predicted step time (result.json's ``throughput.predicted_step_time_s``)."""
DATA_TIME_S = "throughput/data_time_s"
"""The per-step history points of a timed step."""

HISTORY_SUMMARIES = {LOSS: "min", "throughput/*": "none", "memory/*": "none"}
"""``define_metric`` of a job's run: the loss's summary is its minimum; per-step and
per-interval points get no summary, as the summary holds result.json's figures under the
same names instead (the median step time, each rank's peak)."""

BAND = ("min", "median", "max")
"""The statistics over ranks a figure is reported by, beside (or, at many ranks, instead of) one per rank."""


def per_rank_key(rank: int, figure: str) -> str:
    """One rank's figure: ``memory/per_rank/<rank>/<figure>`` (``figure`` may hold ``/``)."""
    return f"memory/per_rank/{rank}/{figure}"


def band_key(figure: str, stat: str) -> str:
    """A figure's statistic over ranks: ``memory/<figure>_<min|median|max>``."""
    return f"memory/{figure}_{stat}"


def by_strategy_key(strategy: str, figure: str) -> str:
    """A copy of a figure keyed by strategy, so that a panel per strategy plots only its runs."""
    return f"by_strategy/{strategy}/{figure}"


def report_key(name: str) -> str:
    """A chart or table of the sweep report's run: ``report/<name>``."""
    return f"report/{name}"


def across_ranks(name: str, values: list[float]) -> dict[str, float]:
    """min / median / max over ranks: one band a dashboard can draw at 64 ranks, where one
    line per rank is unreadable."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return dict(zip((band_key(name, stat) for stat in BAND), (ordered[0], median, ordered[-1])))


PER_RANK_FIGURES = (
    "peak_allocated_mib",
    "peak_reserved_mib",
    "predicted_peak_mib",
    "predicted_peak_reserved_mib",
    "peak_rel_error",
    "model_states_mib",
    "predicted_model_states_mib",
)
"""The figures of ``memory.per_rank`` in the W&B summary (the rest stay in result.json)."""


def summary_values(result: dict[str, Any], strategy: str) -> dict[str, Any]:
    """The W&B summary of a job: each of result.json's numbers under its path there, the
    keys joined by ``/`` (``memory/peak_allocated_mib_max``, ``memory/per_rank/0/peak_allocated_mib``,
    ``throughput/samples_per_s``): one name per figure, the name ``objective=`` takes too.
    Beside them, ``by_strategy/<strategy>/<figure>`` copies two figures for a panel per strategy."""
    out: dict[str, Any] = {k: result[k] for k in ("world_size", "params", "final_loss") if k in result}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = value  # lists (every step's time) stay in result.json and the history

    for section in ("param_digest", "throughput", "device"):
        walk(section, result.get(section) or {})
    memory = result.get("memory") or {}
    for key, value in memory.items():
        if key != "per_rank":
            walk(f"memory/{key}", value)
    for index, entry in enumerate(memory.get("per_rank") or []):
        for key in PER_RANK_FIGURES:
            walk(per_rank_key(index, key), entry.get(key))
    # Keyed by strategy, so that a panel per strategy plots only that strategy's runs
    # (memory and speed against world size, in the sweep's saved workspace).
    out[by_strategy_key(strategy, "samples_per_s")] = (result.get("throughput") or {}).get("samples_per_s")
    out[by_strategy_key(strategy, "peak_allocated_mib_max")] = memory.get("peak_allocated_mib_max")
    # The final evaluation pass is the last point of the history's eval/... series: W&B's
    # summary of each series is that value, under the series' own name.
    return out


OBJECTIVES = (
    "final_loss",
    SAMPLES_PER_S,
    "throughput/tokens_per_s",
    STEP_TIME,
    "throughput/achieved_flops_per_s",
    "throughput/mfu_pct",
    "memory/peak_allocated_mib_max",
    "memory/peak_allocated_mib_mean",
    "memory/model_states_mib_max",
    "memory/predicted_peak_mib_max",
    "eval/final/eval/loss",
)
"""The result.json paths ``objective`` may name (numbers every finished job has; mfu_pct and
tokens_per_s are null where they do not apply, and then count as a failed point)."""

# ------------------------------------------------------------------ the saved workspace's panels

PER_RANK_UP_TO = 8
"""Beyond this many ranks, per-rank panels give way to the band over ranks."""


def panel_keys(world_size: int, strategies: list[str], cuda: bool = False) -> dict[str, list[str]]:
    """The metric keys each section plots (summary or history keys of the sweep's runs). Reserved
    memory is a CUDA caching allocator's figure: its section is there only when a point ran on CUDA."""
    ranks = range(world_size) if world_size <= PER_RANK_UP_TO else []
    keys = {
        "peak per rank": [per_rank_key(r, "peak_allocated_mib") for r in ranks]
        or [band_key("peak_allocated_mib", b) for b in BAND],
        "model states per rank": [per_rank_key(r, f"model_states_mib/{part}") for r in ranks for part in MODEL_STATES]
        or ["memory/model_states_mib_max"],
        "memory over time per rank": [per_rank_key(r, "allocated_mib") for r in ranks],
        "memory over time across ranks": [band_key("allocated_mib", b) for b in BAND],
        "memory vs world size": [by_strategy_key(s, "peak_allocated_mib_max") for s in strategies],
        "throughput vs world size": [by_strategy_key(s, "samples_per_s") for s in strategies],
        "predicted vs measured": ["memory/predicted_peak_mib_max", "memory/peak_allocated_mib_max"],
        "predicted vs measured step time": [PREDICTED_STEP_TIME, STEP_TIME],
        "parallel coordinates": ["memory/peak_allocated_mib_max", SAMPLES_PER_S, "final_loss"],
    }
    if cuda:
        keys[RESERVED_SECTION] = ["memory/predicted_peak_reserved_mib_max", "memory/peak_reserved_mib_max"]
    return keys


RESERVED_SECTION = "reserved: predicted vs measured (CUDA)"


CONFIG_AXES = ["strategy.name", "precision.name", "trainer.world_size", "model.name"]
"""Run config keys the view groups and filters by (W&B flattens nested config with dots)."""

GROUP_BY = ["strategy.name", "trainer.world_size", "precision.name"]
"""One group per point: W&B aggregates only runs that differ in nothing else (seeds)."""
