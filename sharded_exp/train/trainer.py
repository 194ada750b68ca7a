"""The training loop that runs on every rank, read top to bottom.

:func:`train` is called once per rank with the process group already initialised (by
:mod:`sharded_exp.launch.rank`). It builds model, strategy and data from the plain
resolved config, runs the loop (:func:`run_loop`, public: ``benchmarks/overhead.py``
times it against a hand-written loop) and returns, on rank 0, the payload that becomes
``result.json``. The step itself is :func:`train_step`; the trainer never asks which
strategy it runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from sharded_exp import checkpoint
from sharded_exp.data import Task
from sharded_exp.data.loader import step_loader
from sharded_exp.errors import is_oom
from sharded_exp.measure.flops import utilisation
from sharded_exp.measure.profile import StepProfiler, trace_path
from sharded_exp.measure.snapshot import MemoryHistory
from sharded_exp.measure.tracker import MemoryMeter, model_state_mib, process_peak_rss_mib
from sharded_exp.output.loggers import NullLogger, build_logger, memory_values, summary_values
from sharded_exp.output.results import memory_section, training_result
from sharded_exp.strategies.base import Strategy
from sharded_exp.train import evaluate as evaluation
from sharded_exp.train import liveness
from sharded_exp.train.build import build_run
from sharded_exp.train.faults import Injector
from sharded_exp.train.metrics import IntervalLog, IntervalMetrics, throughput_stats
from sharded_exp.train.step import train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopSettings:
    """The trainer config's values the loop reads, as plain attributes (an OmegaConf
    lookup costs tens of microseconds, several per step)."""

    steps: int
    warmup_steps: int
    batch_size: int
    grad_accum: int
    grad_clip: float
    log_interval: int
    progress_bar: bool = False
    label: str = ""
    compiled: bool = False
    profile_steps: int = 0
    """Steps profiled right after warm-up (trainer.profile); 0: none."""

    @classmethod
    def from_config(cls, trainer_cfg, label: str = "") -> "LoopSettings":
        t = trainer_cfg
        return cls(
            t.steps, t.warmup_steps, t.batch_size, t.grad_accum, t.grad_clip, t.log_interval, t.progress_bar, label,
            bool(t.get("compile", False)), t.profile_steps if t.get("profile", False) else 0,
        )  # fmt: skip


@dataclass
class LoopOutcome:
    """What one run of the loop did, on every rank."""

    steps_done: int
    loss: torch.Tensor
    """The last step's loss on this rank (not yet reduced)."""
    history: list[dict[str, float]]
    throughput: dict[str, float]
    memory: dict[str, Any]
    skipped_steps: int
    first_step_unix: float
    last_step_unix: float = 0.0
    checkpoint: str | None = None
    stopped: bool = False
    evals: list[dict[str, float]] = field(default_factory=list)
    """Evaluation records (``step`` and ``eval/*`` values)."""
    extra: dict[str, Any] = field(default_factory=dict)


def run_loop(
    strategy: Strategy,
    task: Task,
    autocast,
    loop: LoopSettings,
    *,
    start: int = 0,
    meter: MemoryMeter,
    stopper: liveness.StopAgreement,
    logger=NullLogger(),
    faults: Injector | None = None,
    checkpoints: checkpoint.Checkpointer | None = None,
    evaluate=None,
    eval_every: int = 0,
    profile_path: str | None = None,
    data_position: dict | None = None,
) -> LoopOutcome:
    """Train steps ``start`` to ``loop.steps`` on this rank (a collective: every rank calls it).

    Memory is measured by ``meter`` (on CPU over the warm-up steps only), a stop requested
    by a signal is agreed through ``stopper``, metrics go to ``logger`` one interval late,
    ``faults`` acts out a testing aid, ``checkpoints`` writes the checkpoints that are due,
    and ``evaluate(step) -> {"eval/...": value}`` runs every ``eval_every`` steps (outside
    the memory window) and at the end. ``profile_path``: where this rank's trace of
    ``loop.profile_steps`` steps after warm-up goes (those steps are not timed). ``data_position``: where a resumed run starts in a
    user's dataset (the checkpoint's; None: at ``start``).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = meter.device
    # A (re)started process warms up again: the first steps after ``start`` are not timed,
    # but at least one step is. The CPU memory tracker slows every op: it runs over the
    # warm-up steps, and over two at least, as the first step's forward and backward run
    # before the optimizer's state exists and the second is the steady one. Tracked steps
    # are not timed, unless a run is too short to time any other.
    warmup = min(loop.warmup_steps, loop.steps - start - 1)
    memory_end = loop.steps
    compile_step = start  # where trainer.compile's units compile (the first step they run tracked by nothing)
    if device.type == "cpu":
        memory_end = start + min(max(warmup, 2), loop.steps - start)
        warmup = min(memory_end - start, loop.steps - start - 1)
        if loop.compiled:
            # Dynamo skips, for good, a function first called under a dispatch mode (the CPU
            # tracker's): the tracked steps run eager, its caches are reset after them, and
            # the units compile in one more untimed step.
            compile_step = memory_end
            warmup = min(memory_end - start + 1, loop.steps - start - 1)
    profiler = None
    if loop.profile_steps and profile_path is not None:
        # Right after warm-up (and the CPU tracker's window), before the timed steps: the
        # profiled steps are left out of the timing, one timed step at least remains.
        count = max(0, min(loop.profile_steps, loop.steps - start - warmup - 1))
        note = None
        if count < loop.profile_steps:
            note = (f"{count} of trainer.profile_steps={loop.profile_steps} profiled: the warm-up"
                    f"{' and the CPU memory tracker' if device.type == 'cpu' else ''} took {warmup} of the "
                    f"{loop.steps - start} steps and one is timed")  # fmt: skip
        profiler = StepProfiler(device, profile_path, start + warmup, count, note)
        warmup += count
    samples_per_step = loop.batch_size * loop.grad_accum * world_size
    metrics, log = IntervalMetrics(device, task, probe=lambda: meter.now(strategy)), IntervalLog(logger)
    # A resumed run's bar starts where the checkpoint left off and ends at 100%.
    bar = tqdm(total=loop.steps, initial=start, desc=loop.label, disable=rank != 0 or not loop.progress_bar)
    memory, step_times, data_times, skipped, tokens_per_step, saved = {}, [], [], 0, 0, None
    first_step_s = None
    # A DataLoader over a user's dataset, or the synthetic tasks' prefetcher; timed by `get`.
    prefetcher = step_loader(task, rank, world_size, loop, device, start, data_position)
    out = LoopOutcome(start, torch.zeros(()), log.history, {}, {}, 0, time.time())
    loop_start = None
    for step in range(start, loop.steps):
        if step == start + warmup:
            # Wall time of whole loop iterations (data, checks, metrics, logging included):
            # what the harness costs on top of train_step, see benchmarks/overhead.py.
            _sync(device)
            loop_start = time.perf_counter()
        if stopper.should_stop(step):  # a signal reached some rank: all stop here, together
            break
        liveness.current_step = step
        if profiler is not None:
            profiler.before_step(step)
        t_data = time.perf_counter()
        batches = prefetcher.get(step)
        data_time = time.perf_counter() - t_data
        if "input_ids" in batches[0]:
            tokens_per_step = batches[0]["input_ids"].numel() * loop.grad_accum * world_size
        if faults is not None:
            faults.before_step(step, strategy)

        scale_before = strategy.scaler.get_scale()
        _sync(device)
        t0 = time.perf_counter()
        if profiler is None:
            loss, output = train_step(strategy, batches, autocast, loop.grad_clip)
        else:
            with profiler.label(step):
                loss, output = train_step(strategy, batches, autocast, loop.grad_clip)
        _sync(device)
        step_time = time.perf_counter() - t0
        if profiler is not None:
            profiler.after_step(step, step_time)  # the last profiled step writes the trace
        liveness.raise_if_aborted(device)  # this step's collective timed out, not the next one's
        if step == compile_step:
            first_step_s = step_time
        if step >= start + warmup:
            step_times.append(step_time)
            data_times.append(data_time)
            log.add(
                step + 1,
                {
                    "throughput/step_time_s": step_time,
                    "throughput/samples_per_s": samples_per_step / step_time,
                    "throughput/data_time_s": data_time,
                },
            )
        if faults is not None:
            faults.after_step()
        # The scaler lowers its scale exactly when it skipped the step (found inf/nan).
        skipped += int(strategy.scaler.get_scale() < scale_before)
        meter.step_end(step)
        if step + 1 == memory_end:
            memory = meter.stop()
            if loop.compiled and device.type == "cpu":
                from torch import _dynamo

                _dynamo.reset()

        metrics.update(loss, output, batches[-1])
        # Let go of this step's output and batch now: otherwise the logits (batch x time x
        # vocab for a language model) stay alive through the next step's peak.
        del output, batches
        bar.update(1)
        if (step + 1) % loop.log_interval == 0 or step + 1 == loop.steps:
            log.publish(metrics.end_interval(step + 1), bar)
        out.steps_done, out.loss = step + 1, loss
        if checkpoints is not None and checkpoints.due(out.steps_done, loop.steps):
            with meter.guard(strategy):  # untimed: the memory budget still holds
                out.checkpoint = checkpoints.save(strategy, out.steps_done, device, prefetcher.position())
                saved = out.steps_done
        if evaluate is not None and eval_every and out.steps_done % eval_every == 0 and not meter.tracking:
            if out.steps_done < loop.steps:  # the last step's pass is the final one, below
                with meter.paused():
                    out.evals.append(_evaluated(evaluate, out.steps_done, log))
    _sync(device)
    loop_end = time.perf_counter()
    position = prefetcher.position()  # before close: a stop's checkpoint below records it
    if profiler is not None:
        profiler.finish()  # stopped inside the profiled steps
        out.extra["profile"] = profiler.record()
    prefetcher.close()
    out.last_step_unix = time.time()
    stopper.finish()
    if metrics.updates:  # stopped in the middle of an interval
        log.publish(metrics.end_interval(out.steps_done), bar)
    log.publish(metrics.flush(), bar)
    bar.close()
    out.stopped = out.steps_done < loop.steps
    if out.stopped and checkpoints is not None and checkpoints.every and saved != out.steps_done:
        # Preempted: the state at the stop is worth more than the last periodic checkpoint.
        with meter.guard(strategy):
            out.checkpoint = checkpoints.save(strategy, out.steps_done, device, position)
    if checkpoints is not None and checkpoints.every:
        checkpoints.finish()  # an asynchronous save still in flight is completed and published
        out.extra["checkpoint_rss_growth_mib"] = checkpoints.rss_growth_mib
    out.memory = memory or meter.stop()
    if evaluate is not None and not out.stopped:
        out.evals.append(_evaluated(evaluate, out.steps_done, log))
    log.flush()
    timed = out.steps_done - start - warmup
    loop_time = (loop_end - loop_start) / timed if loop_start is not None and timed > 0 else None
    out.throughput = throughput_stats(step_times, samples_per_step, tokens_per_step, loop_time, data_times)
    if out.throughput:
        out.throughput["data_prefetched"] = prefetcher.ahead
        out.throughput["first_step_s"] = first_step_s  # the first step (with compile: the compiling one)
        if loop.compiled and first_step_s is not None:  # it is never timed
            out.throughput["compile_s"] = max(0.0, first_step_s - out.throughput["step_time_s_median"])
    out.skipped_steps = skipped
    out.extra["first_nonfinite_step"] = int(metrics.first_nonfinite)
    return out


def _evaluated(evaluate, step: int, log) -> dict[str, float]:
    t0 = time.perf_counter()
    record = {"step": step, **evaluate(step), "seconds": time.perf_counter() - t0}
    log.add(step, {k: v for k, v in record.items() if k.startswith("eval/")})
    return record


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sums(tensors) -> tuple[float, float]:
    total, sq = 0.0, 0.0
    for tensor in tensors:
        t = tensor.detach().to("cpu", torch.float64)
        total += t.sum().item()
        sq += t.pow(2).sum().item()
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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = strategy.module
    final_loss = out.loss.detach().float().clone()
    dist.all_reduce(final_loss)
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
        # Peak resident set of the rank's process (host memory, any framework compares).
        "peak_rss_mib": process_peak_rss_mib(),
    }
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, local)
    return (per_rank if rank == 0 else None), digest, final_loss.item() / world_size


def device_info(device: torch.device) -> dict[str, Any]:
    """What the job ran on, as result.json's ``device`` (``accelerator`` is only what was
    asked for): type, model, count, and the CUDA and NCCL versions on a GPU."""
    import platform

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
    cfg: DictConfig,
    device: torch.device,
    output_dir: str,
    prediction: dict[str, Any],
    timeline: dict[str, float] | None = None,
) -> dict[str, Any] | None:
    """Build, train and measure on this rank; rank 0 returns the result payload.

    ``prediction``: the parent's memory prediction (:func:`~sharded_exp.predict.prediction.predict`),
    set beside the measurement in the payload's ``memory``.
    """
    rank, tc = dist.get_rank(), cfg.trainer
    meter = MemoryMeter(device, tc.memory_limit_mib)
    # From before the model is built, as the CUDA cap: an OOM in the build leaves a snapshot too.
    history = MemoryHistory(tc.get("memory_snapshot", "auto"), device, tc.memory_limit_mib, output_dir, rank)
    try:
        return _train(cfg, device, output_dir, prediction, timeline, meter, history)
    except BaseException as exc:
        if is_oom(exc):
            # What the rank that ran out held, for rank<r>_error.json and then result.json.
            history.dump()
            with contextlib.suppress(AttributeError, TypeError):
                exc.memory_at_oom = {"oom_breakdown": meter.oom_breakdown, "memory_snapshot": history.record()}
        raise
    finally:
        history.stop()


def _train(cfg, device, output_dir, prediction, timeline, meter: MemoryMeter, history: MemoryHistory):
    timeline = timeline if timeline is not None else {}
    stopper = liveness.StopAgreement()  # SIGTERM/SIGINT now ask for a stop, which ranks agree on
    rank, tc = dist.get_rank(), cfg.trainer
    # On CPU only tensors the tracker sees are counted: it starts before the strategy
    # allocates its communication buffers, as the CUDA allocator would count them.
    # model.pretrained's weights are loaded, unless a checkpoint's replace them at once.
    run = build_run(cfg, device, before_wrap=meter.start if device.type == "cpu" else None, after_build=meter.built,
                    weights=not tc.resume)  # fmt: skip
    module, strategy, task = run.module, run.strategy, run.task
    loaded = checkpoint.load(strategy, tc.resume, device) if tc.resume else {"step": 0, "resume_changes": []}
    start, resume_changes = loaded["step"], loaded["resume_changes"]  # the parent resolved the path
    if (tc.resume or cfg.model.get("pretrained")) and device.type == "cpu":
        meter.reset_peak()  # the loading's own copies are not the training's peak
    if rank == 0:
        for c in resume_changes:
            print(f"warning: resuming with optimizer group {c['group']} {c['key']}={c['config']} from the config "
                  f"(the checkpoint has {c['checkpoint']})", file=sys.stderr, flush=True)  # fmt: skip
    if device.type == "cuda":
        meter.start()  # peak counters reset once model and optimizer are built
    timeline["built"] = time.time()
    logger = build_logger(cfg.logger, OmegaConf.to_container(cfg, resolve=True), output_dir, rank)
    timeline["logger_ready"] = time.time()
    loop = LoopSettings.from_config(tc, label=f"{cfg.strategy.name} x{dist.get_world_size()}")
    autocast = run.autocast
    batches = tc.eval_batches

    def evaluate(step: int) -> dict[str, float]:
        return evaluation.evaluate(strategy, task, autocast, device, batches, rank)

    try:
        meter.check_build()  # a build over the budget fails here, the logger recording it
        out = run_loop(
            strategy,
            task,
            autocast,
            loop,
            start=start,
            meter=meter,
            stopper=stopper,
            logger=logger,
            faults=Injector(rank, device),
            checkpoints=checkpoint.Checkpointer.from_config(cfg),
            evaluate=evaluate if batches > 0 else None,
            eval_every=tc.eval_every,
            profile_path=trace_path(output_dir, rank),
            data_position=loaded.get("data"),
        )
        if history.mode == "always":
            history.dump()
        out.extra["memory_snapshot"] = history.record()  # before the gather, which sends it to rank 0
        with meter.guard(strategy):  # untimed: the memory budget still holds
            per_rank, digest, final_loss = gather_results(strategy, out, device)
            # Only when asked: the full model, gathered one tensor at a time to rank 0.
            final_state = checkpoint.gather_model_state(strategy) if tc.save_final_state and not out.stopped else None
        history.stop()  # recorded through the gathers: an OOM there dumps its snapshot (train's handler)
    except BaseException:
        logger.finish(exit_code=1)
        raise
    payload = None
    if per_rank is not None:
        flops = (prediction.get("peak") or {}).get("flops_per_step")
        if out.throughput:  # model FLOPs from the parent's fake step over this run's step time
            world_size = dist.get_world_size()
            out.throughput["model_flops_per_step"] = flops * world_size if flops else None
            out.throughput.update(utilisation(flops, out.throughput["step_time_s_median"], device, cfg.precision.name))
        if final_state is not None:
            torch.save(final_state, os.path.join(output_dir, "model_final.pt"))
        payload = training_result(
            out,
            per_rank,
            digest,
            final_loss,
            start=start,
            world_size=dist.get_world_size(),
            resumed_from=tc.resume,
            resume_changes=resume_changes,
            params=sum(p.numel() for p in module.parameters()),
            signal=stopper.signum,
            memory=memory_section(
                prediction,
                per_rank,
                meter.source,
                MemoryMeter.LIMIT_APPLIES_TO[device.type] if tc.memory_limit_mib else None,
            ),
            timeline=timeline,
            device=device_info(device),
        )
        logger.log(memory_values(payload["memory"]), step=payload["steps_done"])
        logger.summary(summary_values(payload, cfg.strategy.name))
    logger.finish(exit_code=1 if payload is not None and payload["status"] == "diverged" else 0)
    return payload
