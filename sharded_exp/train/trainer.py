"""A job on one rank: build, load, train, measure, gather.

:func:`train` is called once per rank with the process group already initialised (by
:mod:`sharded_exp.launch.rank`), with the job's spec. It builds model, strategy and data
from the spec's config, restores the planned checkpoint, runs the loop
(:func:`sharded_exp.train.loop.run_loop`) with the job's parts (faults, checkpoints,
evaluation), and returns, on rank 0, the payload that becomes ``result.json``. The
trainer never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from sharded_exp import checkpoint
from sharded_exp.checkpoint import CheckpointManager, gather_model_state
from sharded_exp.data.loader import data_changes
from sharded_exp.errors import is_oom
from sharded_exp.job.result import TRAINED, PartialResult, write_json
from sharded_exp.job.spec import JobSpec
from sharded_exp.measure.flops import utilisation
from sharded_exp.measure.host_malloc import heap_free_mib
from sharded_exp.measure.profile import trace_path
from sharded_exp.measure.snapshot import MemoryHistory
from sharded_exp.measure.tracker import MemoryMeter, model_state_mib, process_peak_rss_mib
from sharded_exp.output.loggers import start_logger, summary_values
from sharded_exp.output.results import memory_section, training_result
from sharded_exp.precision import Precision, step_precision
from sharded_exp.speed.against_measured import step_time_figures
from sharded_exp.strategies.base import Strategy
from sharded_exp.train import components, faults, kept_works, liveness
from sharded_exp.train import evaluate as evaluation
from sharded_exp.train.build import Run, build_run
from sharded_exp.train.faults import Injector
from sharded_exp.train.loop import LoopOutcome, LoopSettings, run_loop
from sharded_exp.train.metrics import IntervalLog
from sharded_exp.train.records import Windows

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sums(tensors) -> tuple[float, float]:
    """float64 sum and sum of squares, where the tensors live, without a copy of any: the
    end of a run costs no memory beyond two numbers (a float64 copy of the largest tensor
    could push a point that fitted in training over its budget). The sum is the same, bit
    for bit, as over a float64 copy; the sum of squares agrees to about 1e-14."""
    total, sq = 0.0, 0.0
    for tensor in tensors:
        t = tensor.detach()
        if t.numel() == 0:
            continue
        total += t.sum(dtype=torch.float64).item()
        if t.is_floating_point() or t.is_complex():
            sq += torch.linalg.vector_norm(t, dtype=torch.float64).item() ** 2
        else:  # integer buffers (a step count): small, and vector_norm takes floats only
            sq += t.to(torch.float64).pow(2).sum().item()
    return total, sq


def param_digest(module: torch.nn.Module, device: torch.device) -> dict[str, float]:
    """float64 sum and L2 norm over the full model state, the same for every strategy,
    without gathering it: sums over disjoint shards add up, so each rank sums the shards it
    holds (DTensor shards) and rank 0 alone counts what every rank holds whole. Collective:
    one all-reduce of two numbers."""
    mine = []
    for tensor in module.state_dict().values():
        sharded = isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)
        if sharded:  # counted by the first replica of each shard (HSDP replicates shards)
            mesh = tensor.device_mesh
            if all(mesh.get_local_rank(d) == 0 for d, p in enumerate(tensor.placements) if p.is_replicate()):
                mine.append(_local(tensor))
        elif dist.get_rank() == 0:
            mine.append(_local(tensor))
    sums = torch.tensor(_sums(mine), dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    total, sq = sums.tolist()
    return {"sum": total, "l2": math.sqrt(sq)}


def gather_results(strategy: Strategy, out: LoopOutcome, device: torch.device) -> tuple[list | None, dict, float]:
    """After the loop, on every rank (collective): each rank's figures gathered to rank 0.

    Returns (per-rank entries on rank 0, else None; the parameter digest; the final loss
    averaged over ranks). Nothing here gathers the model.
    """
    rank = dist.get_rank()
    module = strategy.module
    digest = param_digest(module, device)
    total, sq = _sums(_local(p) for p in module.parameters())
    local = {
        "rank": rank,
        **out.memory,
        "model_states_mib": model_state_mib(module, strategy.local_optimizers()),
        "optimizer_shard_numel": sum(p.numel() for p in strategy.local_shard()),
        "loss_scale": float(strategy.scaler.get_scale()),
        "skipped_steps": out.skipped_steps,
        "nonfinite_params": sum(int((~torch.isfinite(_local(p))).sum()) for p in module.parameters()),
        "local_param_digest": {"sum": total, "l2": math.sqrt(sq)},
        # Buffers (BatchNorm's running statistics) are whole on every rank: they agree
        # across ranks when the strategy broadcasts them, as DDP does.
        "buffer_digest": dict(zip(("sum", "l2"), _sums(module.buffers()))),
        **out.extra,
        # Peak resident set of the rank's process (host memory, any framework compares), and
        # what of it glibc's heaps hold free (the blocks below the rank's mmap threshold).
        "peak_rss_mib": process_peak_rss_mib(),
        "heap_free_mib": heap_free_mib(),
    }
    per_rank = kept_works.all_gather_object(local)  # kept: near the teardown (kept_works)
    return (per_rank if rank == 0 else None), digest, out.final_loss  # reduced at the loop's end (Metrics)


def device_info(device: torch.device) -> dict[str, Any]:
    """What the job ran on, as result.json's ``device`` (``accelerator`` is only what was
    asked for): type, model, count, and the CUDA and NCCL versions on a GPU."""
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count(),
                "threads_per_rank": torch.get_num_threads()}  # fmt: skip
    props = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None
    return {
        "type": "cuda",
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": props.total_memory / 2**30,
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
    }


def train(
    spec: JobSpec,
    device: torch.device,
    timeline: dict[str, float] | None = None,
    released: Callable[[], dict | None] | None = None,
) -> dict[str, Any] | None:
    """Build, train and measure on this rank; rank 0 returns the result payload.

    ``spec.prediction``: the parent's memory prediction, set beside the measurement in the
    payload's ``memory``. ``released``: waited for once the run is built, before the logger
    and the first step; it gives the peak prediction, made by the parent meanwhile
    (:attr:`JobSpec.wait_for_release`).
    """
    cfg, rank = spec.cfg(), dist.get_rank()
    tc = cfg.trainer
    meter = MemoryMeter(device, tc.memory_limit_mib)
    # From before the model is built, as the CUDA cap: an OOM in the build leaves a snapshot too.
    history = MemoryHistory(tc.memory_snapshot, device, tc.memory_limit_mib, spec.output_dir, rank)
    try:
        return _train(spec, cfg, device, timeline if timeline is not None else {}, meter, history, released)
    except BaseException as exc:
        if is_oom(exc):
            # What the rank that ran out held, for rank<r>_error.json and then result.json.
            history.dump()
            with contextlib.suppress(AttributeError, TypeError):
                exc.memory_at_oom = {"oom_breakdown": meter.oom_breakdown, "memory_snapshot": history.record()}
        raise
    finally:
        history.stop()


def checkpoint_job(cfg) -> dict[str, Any]:
    """What a checkpoint's meta.json records about the job that wrote it."""
    return {
        "strategy": cfg.strategy.name,
        "precision": str(Precision.of(cfg)),
        "optimizer": cfg.optimizer.name,
        # plain data, nested parts included (a Hugging Face model's ``config``)
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "settings": trajectory_settings(cfg),
    }


TRAJECTORY_SETTINGS = ("trainer.zero_grad", "optimizer.foreach", "model.attn_implementation", "data._target_",
                       "data.kwargs")  # fmt: skip
"""Settings a resumed run may change without being refused, but which change its numbers (the
gradient zeroing rule, the optimizer's kernel, the attention's kernel, a custom dataset's
factory and its arguments, which its length alone does not tell apart): recorded in meta.json
and, when a resumed run differs, in result.json's ``resume_changes``."""


def trajectory_settings(cfg) -> dict[str, Any]:
    out = {}
    for key in TRAJECTORY_SETTINGS:
        value = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(value):  # data.kwargs: plain data, as meta.json holds it
            value = OmegaConf.to_container(value, resolve=True)
        out[key] = getattr(value, "value", value)  # an enum by its name in the config
    return out


def setting_changes(loaded: dict[str, Any], cfg) -> list[dict[str, Any]]:
    """The :data:`TRAJECTORY_SETTINGS` this run sets differently from the checkpoint it resumes
    (a checkpoint written before they were recorded: its model config's attention only)."""
    saved = dict(loaded.get("settings") or {})
    model = loaded.get("model")
    if "model.attn_implementation" not in saved and isinstance(model, dict) and "attn_implementation" in model:
        saved["model.attn_implementation"] = model["attn_implementation"]
    now = trajectory_settings(cfg)
    return [
        {"key": k, "checkpoint": saved[k], "config": now[k]}
        for k in TRAJECTORY_SETTINGS
        if k in saved and saved[k] != now[k]
    ]


def _train(spec: JobSpec, cfg, device, timeline, meter: MemoryMeter, history: MemoryHistory, released=None):
    """:func:`train`'s steps, top to bottom: build and load, the parent's release, the logger,
    the loop with the job's parts, the gather, the final evaluation, rank 0's payload."""
    stopper = liveness.StopAgreement()  # SIGTERM/SIGINT now ask for a stop, which ranks agree on
    rank, tc, output_dir = dist.get_rank(), cfg.trainer, spec.output_dir
    run, loaded, resume_changes = _build_and_load(spec, cfg, device, meter)
    strategy, task, autocast, batches = run.strategy, run.task, run.autocast, tc.eval_batches
    if device.type == "cuda":
        meter.start()  # peak counters reset once model and optimizer are built
    timeline["built"] = time.time()
    if released is not None:  # the parent's peak prediction, made while this rank started
        peak = released()
        if peak is not None:
            spec.prediction["peak"] = peak
    # W&B starts beside the first steps, not before them: its timeline entry is when it has started
    logger = start_logger(cfg.logger, OmegaConf.to_container(cfg), output_dir, rank,
                          on_started=lambda t: timeline.__setitem__("logger_ready", t))  # fmt: skip
    intervals = IntervalLog(logger)  # the history of interval records, in step order
    loop = LoopSettings.from_config(tc, label=f"{cfg.strategy.name} x{dist.get_world_size()}")
    report = _Report(spec, cfg, device, meter, run.module, stopper, timeline, loaded["step"], resume_changes)

    def evaluate(step: int) -> dict[str, float]:
        return evaluation.evaluate(strategy, task, autocast, device, batches, rank)

    try:
        meter.check_build()  # a build over the budget fails here, the logger recording it
        checkpoints = CheckpointManager.create(spec.checkpoint, checkpoint_job(cfg), during_write=faults.in_save)
        parts = [
            components.Faults(Injector(rank, device)),
            components.Checkpoints(checkpoints, strategy, meter, tc.steps),
        ]
        if cfg.logger.name != "none":  # W&B started beside the warm-up: waited for before the timed steps
            warm = Windows.plan(loop, loaded["step"], device, profiling=tc.profile).profile_from
            parts.append(components.TrackerStart(logger, at=warm))
        evaluation_part = components.Evaluation(evaluate, tc.eval_every, meter, intervals, tc.steps)
        if batches > 0:
            parts.append(evaluation_part)
        out = run_loop(strategy, task, autocast, loop, start=loaded["step"], meter=meter, stopper=stopper,
                       log=intervals, components=parts,
                       profile_path=trace_path(output_dir, rank) if tc.profile else None,
                       data_position=loaded.get("data"))  # fmt: skip
        gathered = _gather(strategy, out, spec, meter, history, device)
        if batches > 0 and not out.stopped:
            if rank == 0 and gathered[0] is not None:  # kept, should the pass run out of memory
                write_json(os.path.join(output_dir, TRAINED), report.payload(out, gathered).as_written())
            with meter.paused():
                evaluation_part.final(out)
            intervals.flush()  # its eval/... point, after the loop's own (the series' last: W&B's summary)
        logger.wait_started()  # its time is in the payload's timeline
        payload = report.payload(out, gathered)
    except BaseException:
        logger.finish(exit_code=1)
        raise
    if payload is not None:
        logger.summary(summary_values(payload.as_written(), cfg.strategy.name))
    logger.finish(exit_code=1 if payload is not None and payload.status == "diverged" else 0)
    return payload


def _build_and_load(spec: JobSpec, cfg, device: torch.device, meter: MemoryMeter) -> tuple[Run, dict, list]:
    """The run built on this rank and the planned checkpoint restored into it. Returns the
    run, what was loaded (``step`` 0 for a fresh start) and the resume changes: what this
    run sets differently from the checkpoint it resumes (warned of on rank 0, not refused)."""
    resume = spec.checkpoint.resume
    # On CPU only tensors the tracker sees are counted: it starts before the strategy
    # allocates its communication buffers, as the CUDA allocator would count them.
    # model.pretrained's weights are loaded, unless a checkpoint's replace them at once.
    run = build_run(cfg, device, before_wrap=meter.start if device.type == "cpu" else None, after_build=meter.built,
                    weights=resume is None)  # fmt: skip
    loaded = checkpoint.load(spec.checkpoint, run.strategy, device)
    data_changed = data_changes(loaded.get("data"), run.task)  # another file, or an edited one: told, not refused
    changed_settings = setting_changes(loaded, cfg) if loaded["step"] else []
    if (resume or cfg.model.get("pretrained")) and device.type == "cpu":  # a key of some models only
        meter.reset_peak()  # the loading's own copies are not the training's peak
    if dist.get_rank() == 0:
        _warn_resume_changes(loaded, changed_settings, data_changed)
    return run, loaded, loaded["resume_changes"] + changed_settings + data_changed


def _warn_resume_changes(loaded: dict, changed_settings: list, data_changed: list) -> None:
    """Say what a resumed run changes: optimizer settings, trajectory settings, the data."""
    for c in loaded["resume_changes"]:
        log.warning("warning: resuming with optimizer group %s %s=%s from the config (the checkpoint has %s)",
                    c["group"], c["key"], c["config"], c["checkpoint"])  # fmt: skip
    for c in changed_settings:
        log.warning("warning: resuming with %s=%s from the config (the checkpoint was written with %s): "
                    "the run's numbers follow another trajectory from here", c["key"], c["config"], c["checkpoint"])  # fmt: skip
    if data_changed:
        where = loaded["data"]
        log.warning("warning: resuming on other data than the checkpoint's: %s; its data position (epoch %s, "
                    "%s samples in) may name other samples now",
                    "; ".join(f"{c['key']}={c['config']} (the checkpoint's: {c['checkpoint']})" for c in data_changed),
                    where["epoch"], where["samples"])  # fmt: skip


def _gather(
    strategy: Strategy,
    out: LoopOutcome,
    spec: JobSpec,
    meter: MemoryMeter,
    history: MemoryHistory,
    device: torch.device,
) -> tuple[list | None, dict, float]:
    """After the loop (collective): every rank's figures gathered to rank 0 (see
    :func:`gather_results`) under the memory budget, the CUDA memory history recorded, and
    the full model saved when ``trainer.save_final_state`` asks for it."""
    if history.mode == "always":
        history.dump()
    out.extra["memory_snapshot"] = history.record()  # before the gather, which sends it to rank 0
    with meter.guard(strategy):  # untimed: the memory budget still holds
        gathered = gather_results(strategy, out, device)
        # Only when asked: the full model, gathered one tensor at a time to rank 0.
        save = spec.config["trainer"]["save_final_state"] and not out.stopped
        final_state = gather_model_state(strategy) if save else None
    history.stop()  # recorded through the gathers: an OOM there dumps its snapshot (train's handler)
    if final_state is not None:
        torch.save(final_state, os.path.join(spec.output_dir, "model_final.pt"))
    return gathered


@dataclass
class _Report:
    """What rank 0's payload says about the run besides the loop's outcome and the gathered
    figures: the job, where it started, what changed on resuming, how it was stopped."""

    spec: JobSpec
    cfg: Any
    device: torch.device
    meter: MemoryMeter
    module: torch.nn.Module
    stopper: liveness.StopAgreement
    timeline: dict[str, float]
    start: int
    resume_changes: list[dict[str, Any]]

    def payload(self, out: LoopOutcome, gathered: tuple[list | None, dict, float]) -> PartialResult | None:
        """Rank 0's payload (result.json's training figures) from the loop's outcome; None on other ranks."""
        per_rank, digest, final_loss = gathered
        if per_rank is None:
            return None
        spec, device, world_size = self.spec, self.device, dist.get_world_size()
        flops = (spec.prediction.get("peak") or {}).get("flops_per_step")
        if out.throughput:  # model FLOPs from the parent's fake step over this run's step time
            out.throughput["model_flops_per_step"] = flops * world_size if flops else None
            step_time = out.throughput["step_time_s_median"]
            speed = (self.spec.prediction.get("peak") or {}).get("speed") or {}
            planned = speed.get("peak_flops_per_s") if device.type == "cpu" else None  # one MFU denominator
            out.throughput.update(utilisation(flops, step_time, device, step_precision(self.cfg), planned))
            out.throughput.update(step_time_figures(speed or None, step_time))
        limit_applies = MemoryMeter.LIMIT_APPLIES_TO[device.type] if self.cfg.trainer.memory_limit_mib else None
        return training_result(
            out,
            per_rank,
            digest,
            final_loss,
            start=self.start,
            world_size=world_size,
            resumed_from=spec.checkpoint.resume,
            resume_changes=self.resume_changes,
            params=sum(p.numel() for p in self.module.parameters()),
            signal=self.stopper.signum,
            memory=memory_section(spec.prediction, per_rank, self.meter.source, limit_applies),
            timeline=self.timeline,
            device=device_info(device),
        )
