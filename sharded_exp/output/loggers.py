"""Experiment tracking: one Weights & Biases run per job, owned by rank 0.

W&B is an observer: if it cannot start (no network, bad key, unreachable server) or
fails later, a warning is printed and training goes on; result.json is always written.
Offline runs land in ``<output_dir>/wandb/offline-run-*``; upload them later with
``wandb sync <output_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.strategies import offloads_to_host


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def run_tags(run_config: dict[str, Any]) -> list[str]:
    """Tags that group and filter runs in the W&B UI: strategy, precision, model, world size,
    and each lever that is on (activation checkpointing, compile, HSDP, CPU offload)."""
    t, s = run_config["trainer"], run_config["strategy"]
    ac = str(t.get("activation_checkpointing") or "none")
    levers = {
        f"ac:{ac}": ac != "none",
        "compile": bool(t.get("compile")),
        f"hsdp:{s.get('replicate')}": (s.get("replicate") or 1) > 1,
        "cpu_offload": offloads_to_host(OmegaConf.create(s)),
    }
    return [
        f"strategy:{s['name']}",
        f"precision:{run_config['precision']['name']}",
        f"model:{run_config['model']['name']}",
        f"world_size:{t['world_size']}",
    ] + [tag for tag, on in levers.items() if on]


def init_wandb_run(
    cfg,
    *,
    job_type: str | None,
    name: str | None,
    config: dict | None,
    directory: str,
    tags: list[str] = (),
    run_id: str | None = None,
):
    """Start a W&B run from a logger config: the one place sharded_exp calls ``wandb.init``
    (each job's run, and the sweep report's run). ``tags`` join ``logger.tags``; ``run_id``:
    a fixed id, so that starting the run again replaces it (the sweep report's)."""
    import wandb

    return wandb.init(
        id=run_id,
        resume="allow" if run_id else None,
        project=cfg.get("project"),
        entity=cfg.get("entity"),
        group=cfg.get("group"),
        job_type=job_type,
        name=name,
        tags=list(cfg.get("tags") or []) + list(tags),
        config=config,
        dir=directory,
        # An explicit mode overrides WANDB_MODE, so the environment is read here.
        mode=cfg.get("mode") or os.environ.get("WANDB_MODE") or "offline",
        # Never hand back a run left open by an earlier job in this process.
        reinit="finish_previous",
        settings=wandb.Settings(init_timeout=cfg.get("init_timeout_s", 15.0), console="off", silent=True),
    )


class WandbLogger(NullLogger):
    def __init__(self, cfg, run_config: dict[str, Any], output_dir: str):
        self.run = None
        try:
            self.run = init_wandb_run(
                cfg,
                job_type=cfg.job_type,
                name=cfg.run_name,
                config=run_config,
                directory=output_dir,
                tags=run_tags(run_config),
            )
            self.run.define_metric("loss", summary="min")
            # Per-step and per-interval points; the summary holds result.json's figures under
            # the same names instead (the median step time, each rank's peak).
            self.run.define_metric("throughput/*", summary="none")
            self.run.define_metric("memory/*", summary="none")
        except Exception as exc:  # noqa: BLE001 -- tracking must never stop training
            self._give_up("start", exc)

    def _give_up(self, what: str, exc: BaseException) -> None:
        warnings.warn(f"W&B could not {what} ({type(exc).__name__}: {exc}); training goes on without it", stacklevel=3)
        self.run = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as exc:  # noqa: BLE001
                self._give_up("log", exc)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            try:
                self.run.summary.update(values)
            except Exception as exc:  # noqa: BLE001
                self._give_up("write the summary", exc)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish(exit_code=exit_code)
            except Exception as exc:  # noqa: BLE001
                self._give_up("finish", exc)


def build_logger(cfg, run_config: dict[str, Any], output_dir: str, rank: int) -> NullLogger:
    """The job's logger on rank 0; a no-op everywhere else and for logger=none."""
    if rank != 0 or cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_config, output_dir)


PER_RANK_FIGURES = (
    "peak_allocated_mib", "peak_reserved_mib", "predicted_peak_mib", "peak_rel_error", "model_states_mib",
    "predicted_model_states_mib",
)  # fmt: skip
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
            walk(f"memory/per_rank/{index}/{key}", entry.get(key))
    # Keyed by strategy, so that a panel per strategy plots only that strategy's runs
    # (memory and speed against world size, in the sweep's saved workspace).
    out[f"by_strategy/{strategy}/samples_per_s"] = (result.get("throughput") or {}).get("samples_per_s")
    out[f"by_strategy/{strategy}/peak_allocated_mib_max"] = memory.get("peak_allocated_mib_max")
    # The final evaluation pass is the last point of the history's eval/... series: W&B's
    # summary of each series is that value, under the series' own name.
    return out


def across_ranks(name: str, values: list[float]) -> dict[str, float]:
    """min / median / max over ranks: one band a dashboard can draw at 64 ranks, where one
    line per rank is unreadable."""
    if not values:
        return {}
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {
        f"memory/{name}_min": ordered[0],
        f"memory/{name}_median": median,
        f"memory/{name}_max": ordered[-1],
    }
