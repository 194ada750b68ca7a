"""The parent: the Hydra job's side of a job, from pre-flight to ``result.json``.

:func:`launch` reads top to bottom: hold the run directory, check the config once
(:mod:`sharded_exp.launch.preflight`), write what to expect, run the ranks, lay a failure
over the result, write ``result.json`` and print the summary. ``python -m sharded_exp``'s
ranks start once the config is checked, while the check predicts the peak, where nothing
they do before their first step depends on it (:func:`~sharded_exp.launch.preflight.starts_early`):
what to expect is written when it comes (:func:`_release`), and they step after it. Its parts:

- :mod:`.run_dir`: the run directory and the checkpoint directory, held by one live job
  each; an earlier attempt's records moved aside;
- :mod:`.supervise`: spawning ``trainer.world_size`` ranks and watching them (the first
  failure, SIGTERM/SIGINT passed on, no orphans), or, when started by torchrun or srun
  (:mod:`.layout`), running as that one rank;
- :mod:`.diagnose`: a failed rank turned into the failure laid over the result.

``result.json`` is written here, through its one writer (:func:`sharded_exp.job.result.write_result`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf

from sharded_exp.errors import ConfigError, WontFit
from sharded_exp.job.result import Result, write_result
from sharded_exp.job.spec import JobSpec, this_process
from sharded_exp.launch import forkserver
from sharded_exp.launch.diagnose import failure_result
from sharded_exp.launch.layout import Layout, external_layout
from sharded_exp.launch.run_dir import (
    archive_previous_attempt,
    hold_checkpoints,
    hold_run_dir,
    release_run_dir,
    remove_trained,
    restore_attempt,
    write_job_files,
)
from sharded_exp.launch.supervise import Release, Unreleased, run_ranks
from sharded_exp.output.results import base_result, finished_result, memory_lines, predicted_section, summary_table
from sharded_exp.registry import import_plugins

log = logging.getLogger(__name__)


@dataclass
class Launch:
    """One launch as the parent runs it: what it was given, where its ranks come from, and
    the directories it holds until it ends (released by :func:`launch`, however it ends)."""

    cfg: DictConfig
    """The composed config, as Hydra gave it."""
    output_dir: str
    job_files: dict[str, Any]
    """``.hydra/`` files to write once the config is known good."""
    identity: dict[str, Any]
    """result.json fields that place the job in its sweep (``overrides``, ``sweep_id``)."""
    started: tuple[float, float] | None
    """When ``__main__`` started and when it had imported what it needs (None: not from __main__)."""
    launched: float
    """When :func:`launch` began (time.time())."""
    layout: Layout | None
    """Where the ranks come from: None when the parent spawns them, else torchrun's or SLURM's."""
    run_dir_lock: IO | None = None
    checkpoint_lock: IO | None = None
    archived: str | None = None
    """Where an earlier attempt's records were moved (:func:`_hold`), to move back if the job
    is refused after its ranks started."""
    validated: float | None = None
    """When the config was known good (time.time())."""
    predicted: float | None = None
    """When the peak prediction came, where it came after the ranks started (their release)."""

    @property
    def is_writer(self) -> bool:
        """Whether this process writes result.json and prints: the spawning parent, or rank 0
        under torchrun or srun."""
        return self.layout is None or self.layout.rank == 0

    def parent_times(self) -> dict[str, float | None]:
        """The parent's part of result.json's timeline."""
        main, imported = self.started or (None, None)
        times = {"main": main, "imported": imported, "launch": self.launched, "validated": self.validated}
        return times | ({"predicted": self.predicted} if self.predicted is not None else {})


def launch(
    cfg: DictConfig,
    output_dir: str,
    job_files: dict[str, Any] | None = None,
    started: tuple[float, float] | None = None,
    identity: dict[str, Any] | None = None,
    checking: forkserver.Call | None = None,
) -> Result:
    """Check, run every rank, write ``result.json`` and print the summary table.

    Returns the result; its ``status`` is "ok", "stopped" (by a signal), "oom" or
    "failed" (with ``error`` naming the rank). Raises ConfigError before any rank steps.
    Under torchrun only rank 0 writes and prints. ``job_files``: ``.hydra/`` files to
    write once the config is known good. ``identity``: result.json fields that place the
    job in its sweep (``overrides``, ``sweep_id``, see :func:`sharded_exp.report`).
    ``checking``: this job's pre-flight check, begun in the rank server
    (:func:`sharded_exp.launch.server_check.start`); the caller cancels it if its answer is not read.
    """
    import_plugins()
    launched = checking.started if checking is not None else time.time()
    run = Launch(cfg, output_dir, job_files or {}, identity or {}, started, launched, external_layout())
    try:
        # A directory that exists may be another live job's: refused at once, before anything
        # is written (a check begun in the rank server is then stopped by the caller). A new
        # one is made (and held) once the config is known good.
        if run.is_writer and os.path.isdir(output_dir):
            run.run_dir_lock = hold_run_dir(output_dir)
        # ConfigError here, before any rank starts, for a config that cannot run (or, for what
        # only the peak's fake step finds, from _release before they step). The command's own
        # rank server has imported what the check needs (torch._dynamo): begun there by
        # __main__, whose ranks then start while it predicts the peak where they may
        # (preflight.starts_early: they wait for it before their first step). Under torchrun,
        # in a library call or a test: here, the peak included.
        if checking is not None:
            spec = dataclasses.replace(checking.result(), **this_process())
        else:
            # lazy: every model and strategy, which __main__'s parent never imports
            from sharded_exp.launch import preflight

            spec = preflight.check(cfg, output_dir, run.layout, peak=run.is_writer)
        result = base_result(
            spec.config,
            spec.params,
            output_dir,
            **run.identity,
            launcher=spec.launcher,
            zero_grad=spec.zero_grad.record(),
        )
        os.makedirs(output_dir, exist_ok=True)
        if run.is_writer:
            _hold(run, spec)
            if not spec.wait_for_release:
                _expect(run, spec, result)
        run.validated = time.time()
        release = None
        if spec.wait_for_release:
            release = Release(lambda: _release(run, spec, result, checking), checking.kill)
        result = _run_ranks(run, spec, result, release)
        if run.is_writer:
            _publish(output_dir, result)
        return result
    finally:
        release_run_dir(run.run_dir_lock, run.checkpoint_lock)


def _hold(run: Launch, spec: JobSpec) -> None:
    """The writer's part before any rank starts: the run and checkpoint directories held and
    an earlier attempt moved aside (a rank's error record is then this attempt's)."""
    if run.run_dir_lock is None:
        run.run_dir_lock = hold_run_dir(run.output_dir)
    if spec.checkpoint.every:
        run.checkpoint_lock = hold_checkpoints(spec.checkpoint)
    run.archived = archive_previous_attempt(run.output_dir, extra=(".hydra",) if run.job_files else ())


def _release(run: Launch, spec: JobSpec, result: Result, checking: forkserver.Call) -> dict:
    """The peak predicted while the ranks started (the check's second answer; its ConfigError
    raised where the job does not fit host memory), what to expect written, and the time: what
    the ranks are released with (:func:`sharded_exp.launch.supervise.spawn`)."""
    peak = spec.prediction["peak"] = checking.result()
    if run.is_writer:
        _expect(run, spec, result)
    run.predicted = time.time()
    return peak


def _expect(run: Launch, spec: JobSpec, result: Result) -> None:
    """Hydra's files and a "running" result.json with the prediction, written before any rank
    steps, so that what to expect is on disk first (and logged: nothing is, before a refusal)."""
    if spec.zero_grad.reason:  # trainer.zero_grad not honoured: said, not silent
        log.warning(
            "note: trainer.zero_grad=%s is not honoured: %s", spec.zero_grad.requested.value, spec.zero_grad.reason
        )
    job_files = run.job_files
    if job_files and spec.config_yaml:  # the config as decided (world size, checkpoint paths)
        job_files = {**job_files, "config.yaml": OmegaConf.create(spec.config_yaml)}
    write_job_files(run.output_dir, job_files)
    write_result(run.output_dir, result.updated(memory=predicted_section(spec.prediction)))
    peaks = (spec.prediction.get("peak") or {}).get("per_rank_mib")
    peak = f", predicted peak {max(peaks):.2f} MiB per rank" if peaks else ""
    log.info(
        "%s x%d on %s (%s), %s parameters%s; output in %s",
        spec.config["strategy"]["name"],
        spec.world_size,
        spec.device_type,
        spec.launcher,
        f"{spec.params:,}",
        peak,
        run.output_dir,
    )


def _run_ranks(run: Launch, spec: JobSpec, result: Result, release: Release | None) -> Result:
    """Run the ranks (``release``: what they wait for before their first step); the finished
    result, or the failure laid over ``result``. What the release raised is raised, the run
    directory as it was found (the ranks never stepped)."""
    try:
        # rank 0's payload carries status "ok" or "stopped"; other torchrun ranks get None
        payload = run_ranks(spec, run.layout, release)
        return finished_result(result, payload, run.parent_times())
    except Unreleased as exc:  # refused (or the check gone) before any rank stepped: as before any started
        if isinstance(exc.cause, ConfigError):  # the run directory as it was found
            restore_attempt(run.output_dir, run.archived)
        raise exc.cause from None
    except Exception as exc:  # noqa: BLE001 -- a rank failed: record it, then let the caller exit non-zero
        return failure_result(result, exc, spec)


def _publish(output_dir: str, result: Result) -> None:
    """Write the final result.json and print the summary table and the memory lines."""
    remove_trained(output_dir)
    write_result(output_dir, result)
    log.info("finished: %s%s", result.status, f" ({result.error})" if result.error else "")
    print(summary_table(result), flush=True)
    for line in memory_lines(result):
        print(line, flush=True)
    print(f"output: {output_dir}", flush=True)


def record_config_error(
    cfg: DictConfig, output_dir: str, exc: Exception, what: str = "config", identity: dict[str, Any] | None = None
) -> Result:
    """A sweep point whose config was refused (``what`` "config"), or that failed
    unexpectedly around its ranks ("unexpected", with the traceback): recorded as a
    failed point, so that every point of a sweep ends with a result.json."""
    archive_previous_attempt(output_dir)
    try:
        data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001 -- a config that cannot resolve: kept as written
        data = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    error = f"config: {exc}" if what == "config" else f"unexpected: {type(exc).__name__}: {exc}"
    status = "oom" if isinstance(exc, WontFit) else "failed"  # predicted not to fit: a result
    result = base_result(data, None, output_dir, status, error, **(identity or {}))
    if what != "config":
        result = result.updated(traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    write_result(output_dir, result)
    return result
