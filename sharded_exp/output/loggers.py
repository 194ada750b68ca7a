"""Experiment tracking: one Weights & Biases run per job, owned by rank 0.

W&B is an observer: if it cannot start (no network, bad key, unreachable server) or
fails later, a warning is printed and training goes on; result.json is always written.
Offline runs land in ``<output_dir>/wandb/offline-run-*``; upload them later with
``wandb sync <output_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.strategies import offloads_to_host
from sharded_exp.vocabulary import wandb_names

# across_ranks and summary_values make W&B names, so they live with them; the trainer and the probe
# import them from here, beside the logger that writes what they make.
from sharded_exp.vocabulary.wandb_names import HISTORY_SUMMARIES, across_ranks, summary_values  # noqa: F401

START_LIMIT_S = 120.0
"""Seconds the training waits for W&B to start (``logger.init_timeout_s`` bounds W&B's own
wait for its service; importing wandb and writing the run's files come on top). Past it the
run goes on without W&B, as when W&B fails to start."""
FINISH_LIMIT_S = 120.0
"""Seconds ``finish`` waits for W&B to close a run (it flushes the run's files, and online
uploads them). Past it the run goes on, the W&B run left unfinished, with a warning."""


def finish_run(run, exit_code: int = 0, limit_s: float | None = None) -> None:
    """``run.finish(exit_code)``, waited for at most ``limit_s`` (:data:`FINISH_LIMIT_S`). W&B's
    finish has no time limit of its own, and a job must never wait forever on an observer:
    past the limit it is left running in a daemon thread and a TimeoutError is raised; an error
    in finish is raised as it came."""
    limit_s = FINISH_LIMIT_S if limit_s is None else limit_s
    failed: list[BaseException] = []

    def finish() -> None:
        try:
            run.finish(exit_code=exit_code)
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=finish, name="tracker-finish", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise TimeoutError(f"W&B's finish did not return within {limit_s:g} s; the W&B run is left unfinished")
    if failed:
        raise failed[0]


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass

    def wait_started(self) -> None:
        """Return once the logger has started (at once: this one has nothing to start)."""


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
                finish_run(run, exit_code=exit_code)
            except Exception as exc:  # noqa: BLE001
                self._give_up("finish", exc)


def build_logger(cfg, run_config: dict[str, Any], output_dir: str, rank: int) -> NullLogger:
    """The job's logger on rank 0; a no-op everywhere else and for logger=none."""
    if rank != 0 or cfg.name == "none":
        return NullLogger()
    return WandbLogger(cfg, run_config, output_dir)


class StartingLogger(NullLogger):
    """A logger that starts in a thread of its own, beside the first training steps.

    W&B's start (its service process, the run's files) takes seconds that the first step
    would otherwise wait for. Whatever is logged meanwhile waits here, in order, and goes to
    the logger once it has started; ``summary`` and ``finish`` wait for it. ``on_started``
    is called (in that thread) when it has, with the time.
    """

    def __init__(self, start: Callable[[], NullLogger], on_started: Callable[[float], None] | None = None):
        self._logger: NullLogger | None = None
        self._waiting: list[tuple[dict[str, float], int]] = []
        self._gave_up = False  # it did not start in time: what comes after goes nowhere
        self._thread = threading.Thread(target=self._start, args=(start, on_started), name="tracker-start", daemon=True)
        self._thread.start()

    def _start(self, start: Callable[[], NullLogger], on_started: Callable[[float], None] | None) -> None:
        try:
            self._logger = start()  # WandbLogger warns and goes on without W&B when it cannot start
        finally:
            if on_started is not None:
                on_started(time.time())

    def _started(self, wait: bool) -> NullLogger | None:
        """The started logger, with what waited sent to it; None while it is still starting
        (``wait``: until it has, at most :data:`START_LIMIT_S`; past that the run goes on
        without W&B, with a warning)."""
        if wait and not self._gave_up:
            self._thread.join(START_LIMIT_S)
            if self._thread.is_alive():
                self._gave_up = True
                warnings.warn(
                    f"W&B had not started {START_LIMIT_S:g} s after it was asked to; training goes on without it",
                    stacklevel=3,
                )
        elif self._thread.is_alive() and not self._gave_up:
            return None
        if self._gave_up:
            return NullLogger()
        logger = self._logger or NullLogger()  # its start failed outside WandbLogger's own handling
        waiting, self._waiting = self._waiting, []
        for metrics, step in waiting:
            logger.log(metrics, step=step)
        return logger

    def log(self, metrics: dict[str, float], step: int) -> None:
        logger = self._started(wait=False)
        if logger is None:
            self._waiting.append((metrics, step))
        else:
            logger.log(metrics, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self._started(wait=True).summary(values)

    def finish(self, exit_code: int = 0) -> None:
        self._started(wait=True).finish(exit_code=exit_code)

    def wait_started(self) -> None:
        self._started(wait=True)


def start_logger(
    cfg, run_config: dict[str, Any], output_dir: str, rank: int, on_started: Callable[[float], None]
) -> NullLogger:
    """:func:`build_logger`, with W&B started beside the first steps (:class:`StartingLogger`);
    ``on_started`` gets the time it has started (at once for a logger with nothing to start)."""
    if rank != 0 or cfg.name == "none":
        on_started(time.time())
        return NullLogger()
    return StartingLogger(lambda: WandbLogger(cfg, run_config, output_dir), on_started)
