"""Per-rank memory, measured: peak allocated over the training steps, and model states.

Two sources, one meaning of ``peak_allocated_mib`` (bytes of live tensors at the peak):

- CUDA: the caching allocator's own counters (``torch.cuda.memory_stats``), reset once the
  model and optimizer are built; also reserved bytes, allocation retries and OOMs.
- CPU has no allocator counters, so live tensors are tracked with torch's ``MemTracker``
  (a TorchDispatchMode that follows every storage from allocation to free and files it as
  parameter, gradient, optimizer state, activation or temporary). It slows every op, so
  on CPU memory is tracked over the warm-up steps only, which are never timed. MemTracker
  is private torch API: everything that reaches into it is in :mod:`.memtracker`.

The peak resident set of each rank's process is reported beside it (``peak_rss_mib``,
host memory that any framework can compare), but never as the headline: on CPU it is
dominated by the torch runtime itself (about 400 MiB).
"""

from __future__ import annotations

import contextlib
import contextvars
import resource
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sharded_exp.vocabulary.memory import BUCKET, OWN_CATEGORIES, TOTAL

if TYPE_CHECKING:
    from sharded_exp.measure.memtracker import PeakTracker

MIB = 2**20


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the distinct storages behind ``tensors``; a storage is counted once."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if isinstance(t, DTensor):
            t = t.to_local()  # this rank's shard
        st = t.untyped_storage()
        key = (st.device, st.data_ptr())
        if key not in seen and st.nbytes() > 0:
            seen.add(key)
            total += st.nbytes()
    return total


def _state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def model_state_mib(module: nn.Module, local_optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float]:
    """Parameters, gradients and optimizer state this rank holds, from the real tensors.

    Storage is deduplicated across the three (a gradient that is a view into a reduce
    bucket counts the whole bucket, once).
    """
    seen: set = set()
    params = _storage_bytes((p for p in module.parameters()), seen)
    grads = _storage_bytes((p.grad for p in module.parameters() if p.grad is not None), seen)
    optim = sum(_storage_bytes(_state_tensors(o), seen) for o in local_optimizers)
    return {"params": params / MIB, "grads": grads / MIB, "optimizer": optim / MIB}


_FILED_AS: contextvars.ContextVar[str | None] = contextvars.ContextVar("filed_as", default=None)


@contextlib.contextmanager
def filed_as(category: str):
    """Tensors allocated inside are filed as ``category`` by the CPU tracker, not as torch
    would file them (an activation, a temporary): ``category`` is one of ours
    (:data:`OWN_CATEGORIES`), and shows in the measured and predicted peak breakdowns under
    its name. The innermost one holds where they nest."""
    if category not in OWN_CATEGORIES:
        raise ValueError(
            f"filed_as({category!r}): not one of our tracker categories; "
            f"sharded_exp.vocabulary.memory.OWN_CATEGORIES lists {', '.join(map(repr, OWN_CATEGORIES))}"
        )
    token = _FILED_AS.set(category)
    try:
        yield
    finally:
        _FILED_AS.reset(token)


def communication_buffers():
    """Tensors allocated inside are a strategy's communication buckets (:data:`BUCKET`) to
    the CPU tracker: a strategy wraps what (re)allocates its buckets during training in it
    (DDP's bucket rebuild). What a strategy allocates while wrapping is filed so anyway."""
    return filed_as(BUCKET)


Reallocation = Callable[[list[torch.Tensor], list[int], bool], None]
"""``(old, new_sizes, old_freed_last)``: see :func:`reallocated`."""

_REALLOCATIONS: contextvars.ContextVar[Reallocation | None] = contextvars.ContextVar("reallocations", default=None)


@contextlib.contextmanager
def watching_reallocations(observer: Reallocation):
    """Inside, :func:`reallocated` tells ``observer`` (the CUDA allocator's trace of a fake
    step, :class:`sharded_exp.predict.alloc_trace.AllocTrace`)."""
    token = _REALLOCATIONS.set(observer)
    try:
        yield
    finally:
        _REALLOCATIONS.reset(token)


def reallocated(old: list[torch.Tensor], new_sizes: list[int], old_freed_last: bool = False) -> None:
    """A strategy's buffers ``old`` give way to new ones of ``new_sizes`` bytes, which a fake
    step cannot make itself: DDP's bucket rebuild, which agrees on the new buckets by
    exchanging values a fake process group does not have. What changes is the blocks a
    caching allocator is asked for, told to the watcher if there is one (else nothing); the
    tracked peak is left as it is. ``old_freed_last``: the old buffers outlive the new ones'
    allocation (gradients that are views into them are copied over first), else they are
    freed first. Freed first, the bytes are the same; freed last, old and new are held
    together for a moment, which the tracked peak does not count (not modelled; said in
    docs/concepts/memory.md)."""
    observer = _REALLOCATIONS.get()
    if observer is not None:
        observer(list(old), [int(s) for s in new_sizes], old_freed_last)


def peak_tracker(limit_mib: float | None = None, skip_views_of_unseen: bool = False) -> PeakTracker:
    """torch's MemTracker, keeping the overall peak only, and made safe to train under
    (:class:`sharded_exp.measure.memtracker.PeakTracker`, the adapter over its private API).

    ``limit_mib``: a budget (``trainer.memory_limit_mib``): what was live when the total
    first went over it is kept in the tracker's ``over_limit``. Tensors allocated inside
    :func:`filed_as` are filed under its category (:func:`communication_buffers`: :data:`BUCKET`). A failure inside the tracker
    switches it off and is kept in its ``failure``; the training step goes on untouched.
    ``skip_views_of_unseen``: for a window that starts mid-training (the probe's), see
    :class:`~sharded_exp.measure.memtracker.PeakTracker`.
    """
    # lazy: torch's private mem_tracker imports torch._inductor and dynamo (about 3 s); paid by a run that tracks
    from sharded_exp.measure.memtracker import PeakTracker

    return PeakTracker(limit_mib, filed_as=_FILED_AS.get, skip_views_of_unseen=skip_views_of_unseen)


def _breakdown_mib(tracker, device: torch.device) -> dict[str, float]:
    """The tracker's peak snapshot as {category: MiB}, ``Total`` included."""
    snap = tracker.get_tracker_snapshot("peak").get(device, {})
    return {str(getattr(k, "value", k)): v / MIB for k, v in snap.items()}


def peak_breakdown_mib(fn: Callable[[], Any], *external: Any, device=torch.device("cpu")) -> dict[str, float]:
    """Run ``fn`` under torch's MemTracker; the peak MiB by category (Parameter, Gradient,
    Optstate, Activation, Temp, Total). ``external``: modules/optimizers built before."""
    tracker = peak_tracker()
    tracker.track_external(*external)
    with tracker:
        fn()
    return _breakdown_mib(tracker, device)


_peak_rss_floor_mib = 0.0  # the process's peak before any reset of the kernel's high-water mark


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def pinned_host_mib() -> float | None:
    """The pinned host memory torch's CachingHostAllocator holds at the end of a CUDA run: its
    blocks, handed out or cached, at their rounded (power-of-two) sizes (``allocated_bytes.current``
    of ``torch.cuda.host_memory_stats``): CPU offload's shards, and the data loader's pinned
    batches. None where it cannot be read."""
    try:
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / MIB
    except Exception:  # noqa: BLE001 -- measuring never breaks a run
        return None


def process_peak_rss_mib() -> float:
    """Peak resident set of this process so far (MiB), also across :func:`host_peak` resets."""
    return max(_peak_rss_floor_mib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


@contextlib.contextmanager
def host_peak(result: dict):
    """Measure the host memory a region of this process adds at its peak: ``result["mib"]``.

    Linux: the kernel's high-water mark is reset (``/proc/self/clear_refs``) and read back
    (``VmHWM``) against the resident set at the start; the process's own peak is kept
    (:func:`process_peak_rss_mib`). Elsewhere: growth of the process peak (a lower bound).
    """
    global _peak_rss_floor_mib
    _peak_rss_floor_mib = process_peak_rss_mib()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_mib("VmRSS")
    except OSError:
        base = None
    before = process_peak_rss_mib()
    yield
    peak = _status_mib("VmHWM") if base is not None else None
    result["mib"] = max(0.0, peak - base) if peak is not None else process_peak_rss_mib() - before


class MemoryMeter:
    """Peak memory of one rank over a region (``start`` ... ``stop``)."""

    LIMIT_APPLIES_TO = {
        "cuda": "reserved bytes of the CUDA caching allocator (its blocks, rounding and workspaces included), "
        "capped from before the model is built",
        "cpu": "live tensors the CPU memory tracker counts, checked at the end of each tracked step and over "
        "checkpoint saves and the end-of-run figures",
    }
    """What ``trainer.memory_limit_mib`` bounds on each device (result.json's ``memory_limit_applies_to``)."""

    def __init__(self, device: torch.device, limit_mib: float | None = None, skip_views_of_unseen: bool = False):
        self.device = device
        self.limit_mib = limit_mib
        self.skip_views_of_unseen = skip_views_of_unseen  # the probe's window: see peak_tracker
        self.source = "cuda_allocator" if device.type == "cuda" else "torch_mem_tracker"
        if device.type == "cuda" and limit_mib:
            # Before anything is built: the cap holds for the model and the optimizer too.
            # The caching allocator then raises torch.OutOfMemoryError past the budget.
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_mib * MIB / total), device)
        self._tracker: Any | None = None
        self._cuda_peaks = {"allocated_bytes.all.peak": 0, "reserved_bytes.all.peak": 0}  # before pauses
        self._cpu_peak_mib: float | None = None  # the tracked window's, once it has ended
        self._live_states_mib: float | None = None  # between steps, after the window
        self.failure: str | None = None
        """Why this rank's peak could not be measured (the figure is then null), or None."""
        self._build_over: str | None = None  # why the build went over the budget (CPU), raised by check_build
        self.build: dict[str, Any] = {"peak_allocated_mib": None, "breakdown_mib": None}
        """The build's peak (``built``), apart from the training's: ``peak_allocated_mib`` and,
        on CPU, ``breakdown_mib`` by category (null where it was not measured)."""
        self.oom_breakdown: dict[str, Any] | None = None
        """CPU: what was live when ``limit_mib`` was first exceeded, once it was (result.json's
        ``memory.oom_breakdown``): step, phase, by category, by module."""

    @property
    def tracking(self) -> bool:
        """True while the CPU tracker runs (its window: the warm-up steps)."""
        return self._tracker is not None

    @contextlib.contextmanager
    def paused(self):
        """An untimed phase whose memory is not the training's (the evaluation pass).

        CUDA: the peak so far is kept and the allocator's peak counters are reset after the
        phase. CPU: call it outside the tracker's window only (see :attr:`tracking`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            for key in self._cuda_peaks:
                self._cuda_peaks[key] = max(self._cuda_peaks[key], stats.get(key, 0))
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def start(self, *external: Any) -> None:
        """Begin the region. ``external``: modules/optimizers built before it, to be counted."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            # alloc_retries and ooms count from here, not from the build (accumulated stats)
            torch.cuda.reset_accumulated_memory_stats(self.device)
            return
        tracker = peak_tracker(self.limit_mib, self.skip_views_of_unseen)
        try:
            if external and isinstance(external[0], nn.Module):
                tracker.name_modules(external[0])
            tracker.track_external(*external)
            tracker.__enter__()
        except Exception as exc:  # noqa: BLE001 -- measuring never breaks training
            self.failure = f"the CPU memory tracker could not start: {type(exc).__name__}: {exc}"[:400]
            return
        self._tracker = tracker

    @contextlib.contextmanager
    def guard(self, strategy):
        """Hold ``trainer.memory_limit_mib`` over an untimed phase (a checkpoint save, the
        end-of-run figures), which the timed window does not cover.

        On CUDA the allocator cap holds everywhere already. On CPU, when a budget is set and
        the timed window's tracker is not running, the phase runs under a MemTracker: the
        model states this rank holds plus the phase's own tensors must fit.
        """
        if self.device.type == "cuda" or not self.limit_mib or self._tracker is not None:
            yield
            return
        # The states this rank holds are known to the tracker from the start: a view or a
        # detached alias of one (a checkpoint writer makes many) is then not counted as new.
        tracker = peak_tracker(self.limit_mib)
        tracker.name_modules(strategy.module)
        tracker.track_external(strategy.module, *strategy.local_optimizers())
        with tracker:
            yield
        peak = _breakdown_mib(tracker, self.device).get(TOTAL, 0.0)
        if tracker.failure is None and peak > self.limit_mib:
            self.oom_breakdown = self._over_limit(tracker, None, "after training")
            at = self.oom_breakdown.get("tracked_mib", peak)  # the one number of this OOM, everywhere
            raise torch.OutOfMemoryError(
                f"live tensors reached {at:.2f} MiB after training (model states included), "
                f"over trainer.memory_limit_mib={self.limit_mib}"
            )

    def now(self, strategy) -> tuple[float, float, float]:
        """This rank's memory now, in MiB: (allocated, peak allocated so far, reserved or -1).

        CUDA: the allocator's counters (host-side reads, no synchronisation). CPU: the
        tracker's live total and peak while it runs; after its window, the model states
        this rank holds, walked once from the real tensors (what is live between steps),
        and the window's peak."""
        if self.device.type == "cuda":
            peak = max(self._cuda_peaks["allocated_bytes.all.peak"], torch.cuda.max_memory_allocated(self.device))
            return (
                torch.cuda.memory_allocated(self.device) / MIB,
                peak / MIB,
                torch.cuda.memory_reserved(self.device) / MIB,
            )
        if self._tracker is not None and self._tracker.failure is None:
            current = self._tracker.get_tracker_snapshot("current").get(self.device, {}).get(TOTAL, 0) / MIB
            return current, self._tracker.get_tracker_snapshot("peak").get(self.device, {}).get(TOTAL, 0) / MIB, -1.0
        if self._live_states_mib is None:
            # Walked once: after the window (its first step made every optimizer state) the
            # sizes of the states a rank holds do not change, and the walk costs ~0.3 ms.
            self._live_states_mib = sum(model_state_mib(strategy.module, strategy.local_optimizers()).values())
        live = self._live_states_mib
        return live, max(live, self._cpu_peak_mib or 0.0), -1.0

    def built(self, strategy) -> None:
        """The end of the build (every parameter holds its initial value, the strategy has
        wrapped the model): its peak is kept apart (:attr:`build`), held to the budget,
        and the training's peak starts from what is live now.

        CUDA: the allocator's peak since the meter was made (its cap holds from there).
        CPU: the tracker's, by category; the tensors still live that are no model state
        are the strategy's communication buckets from then on (:data:`BUCKET`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.build = {"peak_allocated_mib": torch.cuda.max_memory_allocated(self.device) / MIB,
                          "breakdown_mib": None}  # fmt: skip
            return
        tracker = self._tracker
        if tracker is None or tracker.failure is not None:
            return
        try:
            found = tracker.end_of_build(strategy.module, strategy.local_optimizers()).get(self.device, {})
            found = {k: v / MIB for k, v in found.items()}
        except Exception as exc:  # noqa: BLE001 -- measuring never breaks training
            tracker.failure = f"{type(exc).__name__}: {exc}"[:300]
            return
        total = found.pop(TOTAL, sum(found.values()))
        self.build = {"peak_allocated_mib": total, "breakdown_mib": found}
        if self.limit_mib and total > self.limit_mib:
            self.oom_breakdown = self._over_limit(tracker, None, "building the model")
            at = self.oom_breakdown.get("tracked_mib", total)  # the one number of this OOM, everywhere
            self._build_over = (
                f"live tensors reached {at:.2f} MiB while the model was built, over "
                f"trainer.memory_limit_mib={self.limit_mib}"
            )

    def check_build(self) -> None:
        """Raise the out-of-memory error of a CPU build that went over the budget (``built``
        found it; raised here, once the run's logger exists, so its W&B run records the
        failure as a GPU build's would be raised by the allocator itself)."""
        if self._build_over is not None:
            if self._tracker is not None:
                self._tracker.__exit__(None, None, None)
                self._tracker = None
            raise torch.OutOfMemoryError(self._build_over)

    def reset_peak(self) -> None:
        """Start the peak afresh from what is live now (after a checkpoint was loaded: the
        loaded copies are gone, the states they filled stay counted), as the CUDA
        allocator's counters are reset once model and optimizer are ready."""
        tracker = self._tracker
        if tracker is not None and tracker.failure is None:
            tracker.restart_peak()

    def _over_limit(self, tracker, step: int | None, when: str | None = None) -> dict[str, Any]:
        """result.json's ``memory.oom_breakdown`` from ``tracker``'s record of the moment the
        budget was first exceeded."""
        found = tracker.over_limit or {"error": "the tracker saw no moment over the budget"}
        record = {"step": step, "limit_mib": self.limit_mib, **found}
        if when is not None:
            record["phase"] = f"{when} ({found.get('phase')})"
        return record

    def step_end(self, step: int | None = None) -> None:
        """The end of a tracked step (``step``: its number, named in an out-of-memory record)."""
        if self._tracker is None:
            return
        # MemTracker keeps per-module stats that raise on a second iteration otherwise.
        self._tracker.reset_mod_stats()
        if self.limit_mib and self._tracker.failure is None:
            peak = self._tracker.get_tracker_snapshot("peak").get(self.device, {}).get(TOTAL, 0) / MIB
            if peak > self.limit_mib:
                # The CPU stand-in for the CUDA allocator's budget (trainer.memory_limit_mib),
                # checked against the tracked peak at the end of each tracked step; what was
                # live when the budget was first exceeded is kept for result.json.
                self.oom_breakdown = self._over_limit(self._tracker, step)
                self._tracker.__exit__(None, None, None)
                self._tracker = None
                at = self.oom_breakdown.get("tracked_mib", peak)  # the one number of this OOM, everywhere
                raise torch.OutOfMemoryError(
                    f"live tensors reached {at:.2f} MiB, over trainer.memory_limit_mib={self.limit_mib}"
                )

    def stop(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            stats = torch.cuda.memory_stats(self.device)
            peak = {k: max(v, stats.get(k, 0)) for k, v in self._cuda_peaks.items()}
            return {
                "peak_allocated_mib": peak["allocated_bytes.all.peak"] / MIB,
                "peak_reserved_mib": peak["reserved_bytes.all.peak"] / MIB,
                "alloc_retries": stats.get("num_alloc_retries", 0),
                "ooms": stats.get("num_ooms", 0),
                "pinned_host_mib": pinned_host_mib(),
                "peak_breakdown_mib": None,
                "peak_error": None,
                "freed_off_thread_max_mib": None,
                **self._build_figures(),
            }
        tracker, self._tracker = self._tracker, None
        none = {"peak_allocated_mib": None, "peak_reserved_mib": None, "peak_breakdown_mib": None,
                "freed_off_thread_max_mib": None, **self._build_figures()}  # fmt: skip
        if tracker is None:
            return {**none, "peak_error": self.failure}
        tracker.__exit__(None, None, None)
        if tracker.failure is not None:
            self.failure = f"the CPU memory tracker failed: {tracker.failure}"
            return {**none, "peak_error": self.failure}
        breakdown = _breakdown_mib(tracker, self.device)
        total = breakdown.pop(TOTAL, sum(breakdown.values()))
        self._cpu_peak_mib = total
        return {
            "peak_allocated_mib": total,
            "peak_reserved_mib": None,  # no caching allocator on CPU
            "alloc_retries": None,
            "ooms": None,
            "peak_breakdown_mib": breakdown,
            "peak_error": None,
            "freed_off_thread_max_mib": tracker.freed_off_thread_max / MIB,
            **self._build_figures(),
        }

    def _build_figures(self) -> dict[str, Any]:
        return {"build_peak_mib": self.build["peak_allocated_mib"], "build_breakdown_mib": self.build["breakdown_mib"]}
