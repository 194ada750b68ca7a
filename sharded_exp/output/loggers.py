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

from sharded_exp.config import option_name
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
    ac = option_name(t.get("activation_checkpointing")) or "none"
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
            self.run.define_metric("train/loss", summary="min")
            # Per-step points; the summary holds result.json's figures (median, mean) instead.
            self.run.define_metric("throughput/*", summary="none")
            self.run.define_metric("mem/*", summary="max")
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


def summary_values(result: dict[str, Any], strategy: str) -> dict[str, Any]:
    """The flat W&B summary of a job, read from the same payload as result.json."""
    out: dict[str, float | None] = {
        "world_size": result["world_size"],  # a number panels can plot against (throughput vs ranks)
        "params": result["params"],
        "final_loss": result["final_loss"],
        "param_digest/sum": result["param_digest"]["sum"],
        "param_digest/l2": result["param_digest"]["l2"],
    }
    for key, value in result["throughput"].items():
        if not isinstance(value, list):  # every step's time is result.json's (and the history's)
            out[f"throughput/{key}"] = value
    # Keyed by strategy, so that a panel per strategy plots only that strategy's runs
    # (memory and speed against world size, in the sweep's saved workspace).
    strategy = f"by_strategy/{strategy}"
    out[f"{strategy}/samples_per_s"] = result["throughput"].get("samples_per_s")
    out[f"{strategy}/peak_allocated_mib_max"] = (result.get("memory") or {}).get("peak_allocated_mib_max")
    for key, value in ((result.get("eval") or {}).get("final") or {}).items():
        out[key] = value  # eval/accuracy, eval/f1, eval/perplexity, eval/loss: the final pass
    return out


def memory_values(memory: dict[str, Any]) -> dict[str, float]:
    """Per-rank, max-over-ranks and mean-over-ranks memory, as ``mem/...`` keys."""
    out = {}
    for entry in memory["per_rank"]:
        prefix = f"mem/rank{entry['rank']}"
        for key in ("peak_allocated_mib", "peak_reserved_mib"):
            if entry.get(key) is not None:
                out[f"{prefix}/{key}"] = entry[key]
        out[f"{prefix}/model_states_mib"] = sum(entry["model_states_mib"].values())
        out[f"{prefix}/predicted_model_states_mib"] = sum(entry["predicted_model_states_mib"].values())
        for key in ("predicted_peak_mib", "peak_rel_error"):
            if entry.get(key) is not None:
                out[f"{prefix}/{key}"] = entry[key]
    peaks = [e["peak_allocated_mib"] for e in memory["per_rank"] if e.get("peak_allocated_mib") is not None]
    out.update(across_ranks("peak_allocated_mib", peaks))
    keys = (
        "peak_allocated_mib_max",
        "peak_allocated_mib_mean",
        "model_states_mib_max",
        "predicted_model_states_mib_max",
    )
    for key in keys + ("predicted_peak_mib_max", "predicted_peak_mib_mean", "peak_rel_error_max"):
        if memory.get(key) is not None:
            out[f"mem/{key}"] = memory[key]
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
        f"mem/ranks/{name}_min": ordered[0],
        f"mem/ranks/{name}_median": median,
        f"mem/ranks/{name}_max": ordered[-1],
    }
