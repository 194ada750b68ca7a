"""Measure your own training script: per-rank peak memory, its split, step time and a
predicted peak, written as a sharded_exp ``result.json`` that the report compares.

    from sharded_exp.probe import probe

    with probe(model, optimizer, run_dir="outputs/mine/ddp", samples_per_step=32, example=batch) as p:
        for batch in loader:
            loss = model(batch).loss
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            p.step(loss)

The Lightning and Hugging Face ``Trainer`` callbacks (:mod:`sharded_exp.integrations`) are
this class, driven by their framework's hooks. Steps, counted by :meth:`Probe.step`:

- the first ``warmup_steps`` are neither measured for memory on CPU nor timed (the optimizer's
  state appears, the allocator warms up);
- on CPU the next ``track_steps`` run under the memory tracker (torch's ``MemTracker``, as in
  sharded_exp's own runs: it slows every op, so these are not timed); on CUDA the allocator's
  peak counts from the probe's start;
- every later step is timed, up to ``close``.

It never changes the training: no collective, no synchronisation and no read of a tensor's
value before :meth:`Probe.close`, which gathers every rank's figures once (an all-gather on the
default process group) and has rank 0 write ``<run_dir>/result.json`` and, when a W&B run is
open in the process (``wandb.run``, as Lightning's ``WandbLogger`` and the Trainer's
``WandbCallback`` make), the same summary keys a sharded_exp run logs, into that run.
Measuring never breaks training: what cannot be measured or predicted is a null figure with
the reason.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sharded_exp.errors import ConfigError
from sharded_exp.job.result import Device, Result, write_result
from sharded_exp.launch.run_dir import archive_previous_attempt
from sharded_exp.measure.tracker import MemoryMeter, model_state_mib
from sharded_exp.output.loggers import summary_values
from sharded_exp.output.results import largest_and_mean
from sharded_exp.precision import Precision
from sharded_exp.probe import fake
from sharded_exp.probe.summary import summary
from sharded_exp.strategies import name_of_wrapper, traits_of
from sharded_exp.train import kept_works
from sharded_exp.train.metrics import throughput_stats
from sharded_exp.vocabulary.memory import BUCKET


def _dist():
    return dist if dist.is_available() and dist.is_initialized() else None


def detect_strategy(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
    """The strategy in sharded_exp's names, read from the wrappers on the model and the
    optimizer (each strategy's ``Traits.wrappers``: :func:`sharded_exp.strategies.name_of_wrapper`),
    ``single`` without a wrapper or a process group of more than one rank, ``unknown`` with
    one; and what was found."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's and Lightning's wrappers
    found: dict[str, Any] = {"model_wrapper": type(model).__name__, "optimizer": type(optimizer).__name__}
    name, sharding_strategy = name_of_wrapper(model, optimizer)
    if sharding_strategy is not None:  # FSDP1: its sharding strategy says which ZeRO stage
        found["sharding_strategy"] = sharding_strategy
    if name is not None and traits_of(name).baseline and isinstance(model, DistributedDataParallel):
        found["gradient_as_bucket_view"] = bool(getattr(model, "gradient_as_bucket_view", False))
    if name is not None:
        return name, found
    dist = _dist()
    return ("single" if dist is None or dist.get_world_size() == 1 else "unknown"), found


def _precision(model: nn.Module) -> str:
    """The precision the parameters' dtype names (another dtype, float64: its own name)."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    try:
        return Precision.parse(dtype).value
    except ConfigError:
        return str(dtype)


def _launcher() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if os.environ.get("SLURM_PROCID") is not None and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    return "user"


class Probe:
    """One rank's probe of a training loop (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        run_dir: str | None = None,
        *,
        warmup_steps: int = 5,
        track_steps: int = 2,
        samples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        precision: str | None = None,
        strategy: str | None = None,
        framework: dict[str, Any] | None = None,
        source: str = "probe",
        example: Any = None,
        step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        autocast: contextlib.AbstractContextManager | None = None,
        wrapped_before: bool = True,
        ddp: tuple[bool, bool] | None = None,
        grad_accum: int = 1,
    ):
        if warmup_steps < 1 or track_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} and track_steps={track_steps} must be >= 1")
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer under a wrapper
        self.run_dir = run_dir or os.path.join("outputs", "probe", time.strftime("%Y-%m-%d_%H-%M-%S"))
        self.warmup_steps, self.track_steps = warmup_steps, track_steps
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.source, self.framework = source, framework or {}
        self.precision = precision or _precision(model)
        found_strategy, found = detect_strategy(model, optimizer)
        self.strategy = strategy or found_strategy
        self.framework.setdefault("found", found)
        self.wrapped_before = wrapped_before
        self.grad_accum = max(1, int(grad_accum))  # micro-batches per optimizer step (for the prediction)
        self.ddp = ddp or fake.ddp_of(model)  # (under DDP, gradients as bucket views)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.meter = MemoryMeter(self.device, skip_views_of_unseen=True)
        self.steps = 0
        self.ignored_calls = 0  # step() calls with no optimizer step since the previous one
        self._optimizer_steps = 0
        self._steps_at_last_call = 0
        self._hook = self._count_optimizer_steps()
        self.losses: list[torch.Tensor] = []
        self._step_marks: list[Any] = []  # perf_counter on CPU, CUDA events on a GPU
        self._timed_from: int | None = None
        self._memory: dict[str, Any] | None = None
        self._closed = False
        self.prediction: dict[str, Any] = {"peak_mib": None, "error": "no example batch was given (example=)"}
        if example is not None:
            self.predict(example, step_fn, autocast)
        if self.device.type == "cuda":
            self.meter.start()  # the allocator's peak from here
            self._timed_from = warmup_steps

    # ------------------------------------------------------------------ the loop's side
    def predict(self, example: Any, step_fn=None, autocast=None, zero_grad_after_forward: bool = False) -> None:
        """The fake step's peak for a batch like ``example`` (kept as shapes only);
        ``zero_grad_after_forward``: the loop's order is Lightning's (:func:`fake.predict_peak`)."""
        self.prediction = fake.predict_peak(
            self.model,
            self.optimizer,
            example,
            step_fn,
            autocast,
            buckets_seen=True,  # counted in the measured peak on CPU too (see _rank_figures)
            ddp=self.ddp,
            grad_accum=self.grad_accum,
            zero_grad_after_forward=zero_grad_after_forward,
        )

    def _adopt_device(self) -> None:
        """The device the model's parameters are on now, for a probe made while they were on
        the meta device (a model built there and materialised with ``to_empty`` later)."""
        device = next((p.device for p in self.model.parameters()), self.device)
        if device.type == "meta":
            return
        self.device, self.meter = device, MemoryMeter(device, skip_views_of_unseen=True)
        if device.type == "cuda":
            self.meter.start()
            self._timed_from = self.warmup_steps + self.steps

    def _count_optimizer_steps(self):
        """A post-step hook counting the optimizer's real steps, so that a second ``step()``
        call for one optimizer step is not taken for a step (it would halve the step time)."""

        def counted(*_):
            self._optimizer_steps += 1

        try:
            return self.optimizer.register_step_post_hook(counted)
        except Exception:  # noqa: BLE001 -- an optimizer without hooks: every call counts
            return None

    def step(self, loss: torch.Tensor | None = None) -> None:
        """After each optimizer step. ``loss``: the step's loss (read once, at ``close``).

        A call with no optimizer step since the previous call (``step()`` called twice per
        step) is ignored and counted in ``ignored_calls``; once the optimizer has stepped at
        least once, that is: an optimizer whose steps cannot be seen counts every call."""
        if self._optimizer_steps and self._optimizer_steps == self._steps_at_last_call:
            if not self.ignored_calls:  # one write, newline included: every rank says it, at once
                sys.stderr.write(
                    "warning: sharded_exp probe: step() called again with no optimizer step since the last call; "
                    "ignored (call it once per optimizer step)\n"
                )
            self.ignored_calls += 1
            return
        self._steps_at_last_call = self._optimizer_steps
        if self.device.type == "meta":  # made on the meta device, then to_empty: measure where it trains
            self._adopt_device()
        self.steps += 1
        if loss is not None:  # the last one; no .item() here (no synchronisation); a float is taken as it is
            self.losses = [loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))]
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._step_marks.append(event)
            return
        self._step_marks.append(time.perf_counter())
        if self.steps == self.warmup_steps:  # the tracker's window begins with the next step
            self.meter.start(self.model, self.optimizer)
        elif self.steps == self.warmup_steps + self.track_steps and self.meter.tracking:
            self._memory = self.meter.stop()
            self._timed_from = self.steps

    # ---------------------------------------------------------------------- the figures
    def _step_times(self) -> list[float]:
        marks = self._step_marks
        if self._timed_from is None or len(marks) <= self._timed_from:
            return []
        first = self._timed_from - 1  # the mark before the first timed step
        if self.device.type == "cuda":
            marks[-1].synchronize()
            return [marks[i].elapsed_time(marks[i + 1]) / 1000 for i in range(first, len(marks) - 1)]
        return [marks[i + 1] - marks[i] for i in range(first, len(marks) - 1)]

    def _rank_figures(self) -> dict[str, Any]:
        if self.device.type == "meta":
            raise ValueError("the model's parameters are still on the meta device: nothing was trained to measure")
        if self._memory is None:
            self._memory = (
                self.meter.stop()
                if (self.meter.tracking or self.device.type == "cuda")
                else {
                    "peak_allocated_mib": None,
                    "peak_error": self.meter.failure
                    or f"the probe saw {self.steps} step(s): the memory window needs warmup_steps={self.warmup_steps} "
                    f"+ track_steps={self.track_steps} on CPU",
                }
            )
        states = model_state_mib(fake.unwrap(self.model)[0], [self.optimizer])
        entry = {
            **{k: v for k, v in self._memory.items() if not k.startswith("build_")},
            "model_states_mib": states,
            "predicted_peak_mib": self.prediction.get("peak_mib"),
            "buckets_added_mib": 0.0,
            "step_times_s": self._step_times(),
        }
        if self.device.type != "cuda" and self.wrapped_before and entry.get("peak_allocated_mib") is not None:
            # DDP allocated its reduce buckets when it wrapped the model, before the CPU tracker
            # started: they are live through every step, so they are added to the peak, as a
            # sharded_exp run (whose tracker sees the wrapping) files them under Bucket. Read
            # here, after the window, so that reading them adds nothing to it.
            buckets = fake.ddp_buckets_mib(self.model, self.ddp)
            if buckets:
                entry["buckets_added_mib"] = buckets
                entry["peak_allocated_mib"] += buckets
                split = dict(entry.get("peak_breakdown_mib") or {})
                split[BUCKET] = split.get(BUCKET, 0.0) + buckets
                entry["peak_breakdown_mib"] = split
        measured, predicted = entry.get("peak_allocated_mib"), entry["predicted_peak_mib"]
        entry["peak_rel_error"] = (predicted - measured) / measured if measured and predicted is not None else None
        return entry

    def close(self, error: str | None = None) -> Result | None:
        """Gather every rank's figures (once) and write ``result.json`` on rank 0; returns the
        result on rank 0, None elsewhere. Safe to call twice.

        ``error``: the training loop raised (``with probe(...)`` left by an exception). The
        result says ``failed`` with that error, and nothing is gathered: a peer may never
        reach the gather (it may be waiting in a collective of the user's), so rank 0 writes
        its own figures alone."""
        if self._closed:
            return None
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        try:
            mine = self._rank_figures()
        except Exception as exc:  # noqa: BLE001 -- measuring never breaks training
            mine = {"peak_allocated_mib": None, "peak_error": f"{type(exc).__name__}: {exc}"[:300], "step_times_s": []}
        dist = _dist()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        mine["rank"] = rank
        # kept_works: the probe's gather is the last collective before the user's teardown
        gathered = kept_works.all_gather_object(mine) if dist and error is None else [mine]
        if rank != 0:
            return None
        result = self._result(gathered, world)
        if error is not None:
            result = result.updated(status="failed", error=f"rank {rank}: {error}"[:2000])
        result = self._write(result)
        self._to_wandb(result)
        self._say(result)
        return result

    @staticmethod
    def _say(result: Result) -> None:
        """The answer where the user looks: a few lines on what was found and where result.json is."""
        try:
            print(summary(result.as_written()), flush=True)
        except Exception as exc:  # noqa: BLE001 -- the result is written; a summary never fails training
            print(f"warning: sharded_exp probe: no summary ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _write(self, result: Result) -> Result:
        """``result.json`` in ``run_dir``, an earlier one there moved to ``attempts/<n>/`` as a
        run's is; a ``run_dir`` that cannot be written leaves the result in a new temporary
        directory instead, said on stderr: the measurement is not lost, and training is not
        failed after it ended. Returns the result as written (its ``output_dir`` the fallback's)."""
        try:
            archived = archive_previous_attempt(self.run_dir)
            if archived:
                print(
                    f"sharded_exp probe: the earlier result.json in {self.run_dir} moved to {archived}", file=sys.stderr
                )
            write_result(self.run_dir, result)
        except OSError as exc:
            fallback = tempfile.mkdtemp(prefix="sharded_exp_probe_")
            result = result.updated(output_dir=fallback)
            write_result(fallback, result)
            print(
                f"error: sharded_exp probe: run_dir={self.run_dir} cannot be written ({exc.strerror or exc}); "
                f"the result is in {fallback}/result.json",
                file=sys.stderr,
            )
        return result

    def _result(self, per_rank: list[dict[str, Any]], world: int) -> Result:
        times = per_rank[0].pop("step_times_s", [])
        for r in per_rank[1:]:
            r.pop("step_times_s", None)
        samples = (self.samples_per_step or 0) * world
        throughput = throughput_stats(times, samples, (self.tokens_per_step or 0) * world, None) if times else {}
        if not self.samples_per_step:
            for key in [k for k in throughput if k.startswith("samples_per_s")]:
                throughput[key] = None  # the step time stands; samples/s needs samples_per_step
        memory = {
            "source": self.meter.source,
            "per_rank": per_rank,
            **largest_and_mean(per_rank),
            "peak_prediction": {k: v for k, v in self.prediction.items() if k != "peak_mib"},
        }
        if any(r.get("buckets_added_mib") for r in per_rank):
            memory["peak_note"] = (
                "CPU: the probe started after DDP wrapped the model, so its tracker did not see DDP's reduce buckets "
                "(allocated then); their size, read from DDP's reducer, is added to the measured peak (Bucket) and "
                "is buckets_added_mib"
            )
        losses = [float(t) for t in self.losses]
        params = sum(p.numel() for p in fake.unwrap(self.model)[0].parameters())
        cuda = self.device.type == "cuda"
        return Result.build(
            status="ok",
            source=self.source,
            strategy=self.strategy,
            precision=self.precision,
            model=fake.model_name(self.model),
            optimizer=type(self.optimizer).__name__.lower(),
            world_size=world,
            accelerator=self.device.type,
            params=params,
            steps=self.steps,
            steps_done=self.steps,
            output_dir=os.path.abspath(self.run_dir),
            config={
                "source": self.source,
                "framework": self.framework,
                "warmup_steps": self.warmup_steps,
                "track_steps": self.track_steps,
                "samples_per_step": self.samples_per_step,
                "grad_accum": self.grad_accum,
                "ignored_step_calls": self.ignored_calls,
            },
            launcher=_launcher(),
            final_loss=losses[-1] if losses else None,
            memory=memory,
            throughput=throughput,
            device=Device(
                type="cuda" if cuda else "cpu",  # meta ops run on the host
                name=torch.cuda.get_device_name(self.device) if cuda else platform.processor() or None,
                count=torch.cuda.device_count() if cuda else os.cpu_count(),
                threads_per_rank=torch.get_num_threads(),
            ),
        )

    def _to_wandb(self, result: Result) -> None:
        wandb = sys.modules.get("wandb")  # never imported here: only a run the user opened
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is None:
            return
        try:
            run.summary.update(
                {k: v for k, v in summary_values(result.as_written(), self.strategy).items() if v is not None}
            )
        except Exception as exc:  # noqa: BLE001 -- W&B never fails the user's training
            print(f"warning: sharded_exp probe: W&B summary not written: {exc}", file=sys.stderr)

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(None if exc_type is None else f"{exc_type.__name__}: {exc}")


def probe(model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: str | None = None, **kwargs) -> Probe:
    """A :class:`Probe` of a plain loop, as a context manager (``with probe(...) as p``)."""
    return Probe(model, optimizer, run_dir, **kwargs)
