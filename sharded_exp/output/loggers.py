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
from sharded_exp.vocabulary import wandb_names

# across_ranks and summary_values make W&B names, so they live with them; the trainer and the probe
# import them from here, beside the logger that writes what they make.
from sharded_exp.vocabulary.wandb_names import HISTORY_SUMMARIES, across_ranks, summary_values  # noqa: F401


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def run_tags(run_config: dict[str, Any]) -> list[str]:
    """A job's W&B tags (:func:`sharded_exp.vocabulary.wandb_names.run_tags`) from its resolved config."""
    t, s = run_config["trainer"], run_config["strategy"]
    return wandb_names.run_tags(
        s["name"],
        run_config["precision"]["name"],
        run_config["model"]["name"],
        t["world_size"],
        activation_checkpointing=str(t.get("activation_checkpointing") or "none"),
        compile=bool(t.get("compile")),
        replicate=s.get("replicate"),
        cpu_offload=offloads_to_host(OmegaConf.create(s)),
    )


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
    import wandb  # lazy: wandb (about 0.8 s) only when a run logs to W&B

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
            for key, summary in HISTORY_SUMMARIES.items():
                self.run.define_metric(key, summary=summary)
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
