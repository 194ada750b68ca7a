"""The training loop that runs on every rank, read top to bottom.

:func:`train` is called once per rank with the process group already initialised (by
:mod:`sharded_exp.launch`). It builds model, strategy and data from the plain resolved
config, runs ``trainer.steps`` optimizer steps and returns, on rank 0, the payload that
becomes ``result.json``. The step itself is :func:`train_step`; the trainer never asks
which strategy it runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from sharded_exp import checkpoint, faults, liveness, precision
from sharded_exp.data import build_task
from sharded_exp.loggers import build_logger, memory_values, summary_values
from sharded_exp.memory import MemoryMeter, model_state_mib
from sharded_exp.memory_model import predict_model_states_mib, relative_error
from sharded_exp.models import build_model
from sharded_exp.optim import optimizer_spec
from sharded_exp.strategies import STRATEGIES, build_strategy
from sharded_exp.strategies.base import Strategy


def train_step(strategy: Strategy, batches: list[dict[str, torch.Tensor]], autocast, grad_clip: float):
    """One optimizer step over ``len(batches)`` micro-batches; returns (loss, last output)."""
    strategy.zero_grad()
    total = 0.0
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        # Gradients are communicated on the last micro-batch only.
        with contextlib.nullcontext() if last else strategy.no_sync():
            with autocast:
                out = strategy.model(**batch)
                loss = out.loss / len(batches)
            strategy.scaler.scale(loss).backward()
        total += loss.detach()
    if grad_clip > 0:
        strategy.scaler.unscale_(strategy.optimizer)  # clip the true gradients, not scaled ones
        strategy.clip_grad_norm_(grad_clip)
    strategy.optimizer_step()
    return total, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IntervalMetrics:
    """Loss and accuracy (classifier) or perplexity (language model) per log interval.

    Kept on the device every step (the detached loss; for classifiers the count of correct
    predictions), summed at the end of the interval into one 4-element tensor that is
    all-reduced *asynchronously*, and the record is
    read at the end of the next interval, when the reduction finished long ago: a blocking
    collective every interval made ranks wait for each other's scheduling noise and cost
    6-10% of a 12 ms step on 2 CPU cores (benchmarks/overhead.py). Perplexity is exp of
    the mean token loss over the interval (every step has the same number of tokens).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.name: str | None = None
        self.losses: list[torch.Tensor] = []  # detached, one per step: no op on the hot path
        self.correct: list[torch.Tensor] = []
        self.predictions = 0
        self._in_flight: tuple[int, torch.Tensor, Any] | None = None

    @property
    def updates(self) -> int:
        return len(self.losses)

    def update(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        if logits.dim() == 2:  # classifier logits (batch, classes); LM logits are (batch, time, vocab)
            self.correct.append((logits.detach().argmax(-1) == targets).sum())
            self.predictions += targets.numel()
        self.name = "accuracy" if logits.dim() == 2 else "perplexity"

    def end_interval(self, step: int) -> dict[str, float] | None:
        """Collective (every rank, same step): start reducing this interval; returns the
        previous interval's record, if there is one."""
        previous = self.flush()
        correct = torch.stack(self.correct).sum() if self.correct else torch.zeros((), device=self.device)
        sums = torch.stack(
            [
                torch.stack(self.losses).sum().double(),
                torch.tensor(float(len(self.losses)), dtype=torch.float64, device=self.device),
                correct.double(),
                torch.tensor(float(self.predictions), dtype=torch.float64, device=self.device),
            ]
        )
        self._in_flight = (step, sums, dist.all_reduce(sums, async_op=True))
        self.losses, self.correct, self.predictions = [], [], 0
        return previous

    def flush(self) -> dict[str, float] | None:
        """The record of the interval in flight (waiting for it), if any."""
        if self._in_flight is None:
            return None
        step, sums, work = self._in_flight
        self._in_flight = None
        work.wait()
        loss_sum, steps, correct, predictions = sums.tolist()
        loss = loss_sum / steps
        return {
            "step": step,
            "loss": loss,
            self.name: correct / predictions if self.name == "accuracy" else math.exp(loss),
        }


def memory_section(cfg: DictConfig, per_rank: list, world_size: int, source: str) -> dict[str, Any]:
    """Measured memory per rank next to the analytic prediction (result.json's ``memory``)."""
    with torch.device("meta"):
        module = build_model(cfg.model)
    groups = [[tuple(p.shape) for p in g["params"]] for g in optimizer_spec(cfg.optimizer, module).param_groups]
    strategy_cls = STRATEGIES.config_class(cfg.strategy.name)
    predicted = predict_model_states_mib(strategy_cls, cfg.strategy, cfg.optimizer, groups, world_size)
    for entry, pred in zip(per_rank, predicted):
        entry["predicted_model_states_mib"] = pred
        entry["model_states_rel_error"] = relative_error(pred, entry["model_states_mib"])

    def largest(key):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        return max(values) if values else None

    # Gathered (unsharded) parameters on top of the resident ones, e.g. FSDP's units.
    blocks = [sum(p.numel() for p in block.parameters()) for block in module.blocks()]
    root = sum(p.numel() for p in module.parameters()) - sum(blocks)
    param_bytes = 2 if cfg.precision.name in ("16", "bf16") else 4  # gathered in compute dtype
    transient = strategy_cls.transient_param_numel(cfg.strategy, blocks, root, world_size) * param_bytes / 2**20
    measured_transient = [
        r["peak_breakdown_mib"]["Parameter"] - r["model_states_mib"]["params"]
        for r in per_rank
        if r.get("peak_breakdown_mib")
    ]

    return {
        "source": source,
        "per_rank": per_rank,
        "peak_allocated_mib_max": largest("peak_allocated_mib"),
        "peak_rss_mib_max": largest("peak_rss_mib"),
        "model_states_mib_max": max(sum(r["model_states_mib"].values()) for r in per_rank),
        "predicted_model_states_mib_max": max(sum(p.values()) for p in predicted),
        "model_states_rel_error_max": largest("model_states_rel_error"),
        "predicted_transient_params_mib": transient,
        "transient_params_mib_max": max(measured_transient) if measured_transient else None,
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def param_digest(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """float64 sum and L2 norm over the full state, the same walk for every strategy."""
    total, sq = 0.0, 0.0
    for tensor in state.values():
        t = tensor.detach().to("cpu", torch.float64)
        total += t.sum().item()
        sq += t.pow(2).sum().item()
    return {"sum": total, "l2": math.sqrt(sq)}


def train(
    cfg: DictConfig, device: torch.device, output_dir: str, timeline: dict[str, float] | None = None
) -> dict[str, Any] | None:
    # From here on SIGTERM/SIGINT only ask for a stop, which the ranks agree on.
    timeline = timeline if timeline is not None else {}
    return _train(cfg, device, output_dir, liveness.StopAgreement(), timeline)


def _train(cfg: DictConfig, device: torch.device, output_dir: str, stopper, timeline) -> dict[str, Any] | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tc = cfg.trainer
    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    module = build_model(cfg.model).to(device)
    meter = MemoryMeter(device, tc.memory_limit_mib)
    if device.type == "cpu":
        # On CPU only tensors the tracker sees are counted: start it before the strategy
        # allocates its communication buffers, as the CUDA allocator would count them.
        meter.start(module)
    strategy = build_strategy(cfg.strategy, module, optimizer_spec(cfg.optimizer, module), cfg.precision, device)
    start = 0
    if tc.resume:  # resolved to a checkpoint directory (or null) by the launcher
        start = checkpoint.load(strategy, tc.resume, device)["step"]
    if device.type == "cuda":
        meter.start()  # peak counters reset once model and optimizer are built
    timeline["built"] = time.time()
    logger = build_logger(cfg.logger, OmegaConf.to_container(cfg, resolve=True), output_dir, rank)
    timeline["logger_ready"] = time.time()
    try:
        payload = _loop(cfg, rank, world_size, device, output_dir, module, strategy, meter, logger, start, stopper)
    except BaseException:
        logger.finish(exit_code=1)
        raise
    if payload is not None:
        payload["timeline"] = {**timeline, "first_step": payload["first_step_unix"]}
        logger.log(memory_values(payload["memory"]), step=payload["steps_done"])
        logger.summary(summary_values(payload))
    logger.finish(exit_code=0)
    return payload


def _loop(cfg, rank, world_size, device, output_dir, module, strategy, meter, logger, start, stopper):
    """Steps ``start`` to ``trainer.steps``, then the gather of per-rank results onto rank 0."""
    # Plain attributes: an OmegaConf lookup costs tens of microseconds, several per step.
    tc = SimpleNamespace(**OmegaConf.to_container(cfg.trainer, resolve=True))
    # A (re)started process warms up again: the first steps after ``start`` are not timed,
    # but at least one step is. The CPU memory tracker slows every op: it runs over the
    # warm-up steps (over the first step when there is none; that step is then timed with it).
    warmup = min(tc.warmup_steps, tc.steps - start - 1)
    memory_end = start + (max(warmup, 1) if device.type == "cpu" else tc.steps - start)
    saved_step, checkpoint_path = None, None
    fault = faults.from_env()
    fault = fault if fault is not None and fault.rank == rank else None
    next_batch = build_task(cfg.data, cfg.model, tc.batch_size)
    autocast = precision.autocast(cfg.precision, device.type)
    memory: dict[str, Any] = {}
    metrics = IntervalMetrics(device)
    pending_logs: list[tuple[int, dict[str, float]]] = []  # sent once their interval's record is in

    def publish(record: dict[str, float] | None) -> None:
        """A finished interval: into the history, and to the tracker in step order."""
        if record is None:
            return
        history.append(record)
        pending_logs.append((record["step"], {f"train/{k}": v for k, v in record.items() if k != "step"}))
        ready = sorted((e for e in pending_logs if e[0] <= record["step"]), key=lambda e: e[0])
        pending_logs[:] = [e for e in pending_logs if e[0] > record["step"]]
        for log_step, values in ready:
            logger.log(values, step=log_step)
        bar.set_postfix(loss=f"{record['loss']:.4f}")

    history: list[dict[str, float]] = []
    step_times: list[float] = []
    skipped_steps = 0
    samples_per_step = tc.batch_size * tc.grad_accum * world_size
    tokens_per_step = 0

    bar = tqdm(total=tc.steps, desc=f"{cfg.strategy.name} x{world_size}", disable=rank != 0 or not tc.progress_bar)
    steps_done = start
    first_step_unix, loop_start, loop_end = time.time(), None, None
    for step in range(start, tc.steps):
        if step == start + warmup:
            # Wall time of whole loop iterations (data, checks, metrics, logging included):
            # what the harness costs on top of train_step, see benchmarks/overhead.py.
            _sync(device)
            loop_start = time.perf_counter()
        if stopper.should_stop(step):  # a signal reached some rank: all stop here, together
            break
        liveness.current_step = step
        batches = [
            {k: v.to(device) for k, v in next_batch(step, micro, rank).items()} for micro in range(tc.grad_accum)
        ]
        if "input_ids" in batches[0]:
            tokens_per_step = batches[0]["input_ids"].numel() * tc.grad_accum * world_size
        hook = None
        if fault is not None and fault.step == step:
            if fault.kind == "inf_grad":
                hook = strategy.inject_inf_grad()
            else:
                faults.trigger(fault, rank, device)

        scale_before = strategy.scaler.get_scale()
        _sync(device)
        t0 = time.perf_counter()
        loss, out = train_step(strategy, batches, autocast, tc.grad_clip)
        _sync(device)
        step_time = time.perf_counter() - t0
        if step >= start + warmup:
            step_times.append(step_time)
            pending_logs.append(
                (step + 1, {"train/step_time_s": step_time, "train/samples_per_s": samples_per_step / step_time})
            )
        if hook is not None:
            hook.remove()
        # The scaler lowers its scale exactly when it skipped the step (found inf/nan).
        skipped_steps += int(strategy.scaler.get_scale() < scale_before)
        meter.step_end()
        if step + 1 == memory_end:
            memory = meter.stop()

        metrics.update(loss, out.logits, batches[-1]["targets"])
        # Let go of this step's output and batch now: otherwise the logits (batch x time x
        # vocab for a language model) stay alive through the next step's peak.
        del out, batches
        bar.update(1)
        if (step + 1) % tc.log_interval == 0 or step + 1 == tc.steps:
            publish(metrics.end_interval(step + 1))
        steps_done = step + 1
        if tc.checkpoint_every and (steps_done % tc.checkpoint_every == 0 or steps_done == tc.steps):
            checkpoint_path = checkpoint.save(strategy, cfg, steps_done, tc.checkpoint_dir, device, tc.keep_checkpoints)
            saved_step = steps_done
    _sync(device)
    loop_end = time.perf_counter()
    stopper.finish()
    if metrics.updates:  # stopped in the middle of an interval
        publish(metrics.end_interval(steps_done))
    publish(metrics.flush())
    bar.close()
    stopped = steps_done < tc.steps
    if stopped and tc.checkpoint_every and saved_step != steps_done:
        # Preempted: the state at the stop is worth more than the last periodic checkpoint.
        checkpoint_path = checkpoint.save(strategy, cfg, steps_done, tc.checkpoint_dir, device, tc.keep_checkpoints)
    if not memory:
        memory = meter.stop()

    final_loss = loss.detach().float().clone()
    dist.all_reduce(final_loss)
    state = strategy.full_state_dict()  # collective for strategies that shard parameters
    local = {
        "rank": rank,
        **memory,
        "model_states_mib": model_state_mib(module, strategy.local_optimizers()),
        "optimizer_shard_numel": sum(p.numel() for p in strategy.local_shard()),
        "loss_scale": float(strategy.scaler.get_scale()),
        "skipped_steps": skipped_steps,
        "nonfinite_params": sum(int((~torch.isfinite(_local(p))).sum()) for p in module.parameters()),
        "local_param_digest": param_digest({n: _local(p) for n, p in module.named_parameters()}),
        # Peak resident set of the rank's process (host memory, any framework compares).
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, local)
    if rank != 0:
        return None

    if tc.save_final_state and not stopped:
        torch.save({k: v.cpu() for k, v in state.items()}, os.path.join(output_dir, "model_final.pt"))
    throughput = {}
    if step_times:  # none when stopped by a signal during the warm-up
        median = statistics.median(step_times)
        q = statistics.quantiles(step_times, n=4) if len(step_times) > 1 else [median, median, median]
        throughput = {
            "samples_per_s": samples_per_step / median,
            "step_time_s_median": median,
            "step_time_s_iqr": q[2] - q[0],
            "step_time_s_mean": statistics.fmean(step_times),
            "timed_steps": len(step_times),
        }
        if tokens_per_step:
            throughput["tokens_per_s"] = tokens_per_step / median
        if loop_start is not None and steps_done > start + warmup:
            throughput["loop_time_s_per_step"] = (loop_end - loop_start) / (steps_done - start - warmup)
    return {
        "first_step_unix": first_step_unix,
        "status": "stopped" if stopped else "ok",
        "signal": stopper.signum if stopped else None,
        "start_step": start,
        "steps_done": steps_done,
        "resumed_from": tc.resume,
        "checkpoint": checkpoint_path,
        "params": sum(p.numel() for p in module.parameters()),
        "final_loss": final_loss.item() / world_size,
        "final_metrics": history[-1],
        "param_digest": param_digest(state),
        "throughput": throughput,
        "history": history,
        "memory": memory_section(cfg, per_rank, world_size, meter.source),
    }
