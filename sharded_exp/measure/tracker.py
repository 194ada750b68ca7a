"""Per-rank memory, measured: peak allocated over the training steps, and model states.

Two sources, one meaning of ``peak_allocated_mib`` (bytes of live tensors at the peak):

- CUDA: the caching allocator's own counters (``torch.cuda.memory_stats``), reset once the
  model and optimizer are built; also reserved bytes, allocation retries and OOMs.
- CPU has no allocator counters, so live tensors are tracked with torch's ``MemTracker``
  (a TorchDispatchMode that follows every storage from allocation to free and files it as
  parameter, gradient, optimizer state, activation or temporary). It slows every op, so
  on CPU memory is tracked over the warm-up steps only, which are never timed.

The peak resident set of each rank's process is reported beside it (``peak_rss_mib``,
host memory that any framework can compare), but never as the headline: on CPU it is
dominated by the torch runtime itself (about 400 MiB).
"""

from __future__ import annotations

import contextlib
import contextvars
import resource
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sharded_exp.vocabulary.memory import BUCKET, TOTAL

MIB = 2**20
TOP_MODULES = 5
"""Modules named in an out-of-memory breakdown (the rest are summed)."""


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


_GUARDED = (
    "_pre_fw_hook",
    "_post_fw_hook",
    "_pre_bw_hook",
    "_post_bw_hook",
    "_track",
    "_update_peak_stats",
    "_track_optimizer_states",
)
"""MemTracker's methods that run inside the training step (module hooks, the dispatch
mode's bookkeeping, the optimizer hooks): a failure in one of them is the tracker's."""


_BUCKETS = contextvars.ContextVar("allocating_communication_buffers", default=False)


@contextlib.contextmanager
def communication_buffers():
    """Tensors allocated inside are a strategy's communication buckets (:data:`BUCKET`) to
    the CPU tracker: a strategy wraps what (re)allocates its buckets during training in it
    (DDP's bucket rebuild). What a strategy allocates while wrapping is filed so anyway."""
    token = _BUCKETS.set(True)
    try:
        yield
    finally:
        _BUCKETS.reset(token)


def peak_tracker(limit_mib: float | None = None):
    """torch's MemTracker, keeping the overall peak only, and made safe to train under.

    ``limit_mib``: a budget (``trainer.memory_limit_mib``). When the live total first goes
    over it, what was live then is kept in :attr:`over_limit` (by category, by module, and
    the phase); each new storage is then filed under the module whose forward or backward
    allocated it (the innermost one running), which costs a little per allocation.

    - Its per-module peaks walk every module at every op (7x slower on a 32-layer model)
      and nothing here reads them: only the overall peak is kept.
    - Gradient accumulation calls the root module again before the step ends, which torch
      refuses ("multiple iterative calls"): the per-module stats are dropped instead.
    - A frozen parameter (``requires_grad=False``) cannot take the gradient hook torch puts
      on every parameter: only trainable ones are hooked (a frozen one has no gradient).
    - Measuring never breaks training: a failure inside any of its hooks switches the
      tracker off for the rest of the region and is kept in :attr:`failure`; the training
      step goes on untouched. The op itself (the real work) is never run twice.
    """
    from torch.distributed._tools import mem_tracker  # private torch API: re-check on torch upgrades

    class _Bucket(mem_tracker._RefType):
        BUCKET = BUCKET

    class PeakTracker(mem_tracker.MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self.phase_peaks: dict[tuple, dict] = {}
            """The peak snapshot of each phase, by (device, "optimizer" or "step"): another
            rank's peak may fall in the other phase (a fake step reads both)."""
            self.failure: str | None = None
            """Why the tracker stopped measuring (``Type: message``), or None."""
            self.limit_bytes = limit_mib * MIB if limit_mib else None
            self.over_limit: dict | None = None
            """What was live when the total first went over ``limit_mib`` (see :meth:`_capture`)."""
            self.module_names: dict[int, str] = {}
            """id(module) -> its name in the model (filled by :meth:`name_modules`)."""
            self.freed_off_thread_max = 0
            """Bytes of the largest tensor another thread freed (see :meth:`_delete_callback`)."""
            self._thread = threading.get_ident()
            self._lock = threading.RLock()
            for name in _GUARDED:
                setattr(self, name, self._guarded(getattr(self, name)))

        def _guarded(self, method):
            def call(*args, **kwargs):
                if self.failure is not None:
                    return None
                try:
                    return method(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 -- the measurement fails, not the step
                    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                    self.failure = f"{type(exc).__name__}: {first}"
                    return None

            return call

        def _update_peak_stats(self, peak_state) -> None:
            phase = "optimizer" if self._in_opt else "step"
            for dev, snap in self._curr_mem_snap.items():
                total = snap[mem_tracker._TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                if self.phase_peaks.get((dev, phase), {}).get(mem_tracker._TOTAL_KEY, 0) < total:
                    self.phase_peaks[(dev, phase)] = dict(snap)
                if self.limit_bytes is not None and self.over_limit is None and total > self.limit_bytes:
                    try:
                        self.over_limit = self._capture(dev, snap)
                    except Exception as exc:  # noqa: BLE001 -- the breakdown fails, not the peak
                        self.over_limit = {"error": f"{type(exc).__name__}: {exc}"[:300]}

        def _delete_callback(self, winfo, w_st) -> None:
            # A tensor handed to a collective is freed by whichever thread drops it last: on
            # gloo, now and then its worker thread, after the training thread moved on. Until
            # then it is live (really: its memory is not free), so a peak can hold one such
            # buffer more than the program's order says; the largest is kept as a figure.
            if threading.get_ident() != self._thread:
                self.freed_off_thread_max = max(self.freed_off_thread_max, winfo.mem_consumed)
            with self._lock:  # the snapshot's sums are read-modify-write, from two threads
                super()._delete_callback(winfo, w_st)

        def _update_snap(self, u_type, winfo, *args, **kwargs) -> None:
            with self._lock:
                snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
                snap.setdefault(winfo.reftype, 0)  # our own category (BUCKET) beside torch's
                super()._update_snap(u_type, winfo, *args, **kwargs)
            if self.limit_bytes is not None and u_type == mem_tracker._UpdateType.ADD:
                # The deepest module running (names are dotted paths from the root), or Global
                # when none runs (Global ranks below the root, which has no dot either).
                winfo.owner = max(self._mod_tracker.parents, key=lambda name: (name.count("."), name != "Global"))

        def end_of_build(self, module: nn.Module, optimizers) -> dict[str, float]:
            """The build is over: its peak by category (bytes, ``Total`` included), then the
            model's states filed as such (built inside the window, torch filed them as
            activations), every other tensor still live filed as :data:`BUCKET` (what the
            strategy allocated to communicate), and the peak started afresh."""
            found = {dev: {str(getattr(k, "value", k)): v for k, v in snap.items()}
                     for dev, snap in self.get_tracker_snapshot("peak").items()}  # fmt: skip
            self.track_external(module, *optimizers)
            loose = {mem_tracker._MemRefType.ACT, mem_tracker._MemRefType.TEMP, mem_tracker._MemRefType.OTH}
            for winfo, _ in list(self._WINFO.values()):
                if winfo.reftype in loose:
                    old, winfo.reftype = winfo.reftype, _Bucket.BUCKET
                    self._update_snap(mem_tracker._UpdateType.REF, winfo, old_reftype=old)
            self.restart_peak()
            return found

        def restart_peak(self) -> None:
            """The peak starts afresh from what is live now."""
            current = self.get_tracker_snapshot("current")
            self._peak_mem_snap = current
            self._peak_mem = {dev: snap.get(mem_tracker._TOTAL_KEY, 0) for dev, snap in current.items()}
            self.phase_peaks.clear()

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
            # A gradient that is a view into a communication bucket (ShardedDDP's; DDP's with
            # gradient_as_bucket_view) stays filed as the bucket it lives in: one storage.
            if reftype != _Bucket.BUCKET:
                for st in mem_tracker.get_untyped_storages(t):
                    winfo, _ = self._WINFO.get(st, (None, None))
                    if winfo is not None and winfo.reftype == _Bucket.BUCKET:
                        return {winfo}
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track(self, reftype, tensor) -> None:
            super()._track(_Bucket.BUCKET if _BUCKETS.get() else reftype, tensor)

        def name_modules(self, model: nn.Module) -> None:
            """Name modules as the model does (``layers.0.attn``), not by the wrapper's path."""
            self.module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

        def _capture(self, dev, snap) -> dict:
            """Live bytes now: by category, and by the module that allocated them."""
            if self._in_opt:
                phase = "optimizer"
            elif self._mod_tracker.is_bw:
                phase = "backward"
            elif set(self._mod_tracker.parents) - {"Global"}:
                phase = "forward"
            else:
                phase = "other"  # outside any module and the optimizer: the loss, clipping, communication
            # ModTracker's names run from the root it saw first (the wrapper): map them back.
            ours = {name: self.module_names.get(id(m), name) for m, name in self._mod_tracker._known_modules.items()}
            by_module: dict[str, int] = {}
            for winfo, _ in list(self._WINFO.values()):
                if winfo.device == dev:
                    owner = getattr(winfo, "owner", "Global")
                    by_module[owner] = by_module.get(owner, 0) + winfo.mem_consumed
            outside = by_module.pop("Global", 0)
            top = sorted(by_module.items(), key=lambda kv: -kv[1])[:TOP_MODULES]
            return {
                "phase": phase,
                "tracked_mib": snap[mem_tracker._TOTAL_KEY] / MIB,
                "by_category_mib": {
                    str(getattr(k, "value", k)): v / MIB for k, v in snap.items() if k != mem_tracker._TOTAL_KEY
                },
                "top_modules_mib": {ours.get(name, name): b / MIB for name, b in top},
                "other_modules_mib": sum(by_module.values()) / MIB - sum(b for _, b in top) / MIB,
                "outside_modules_mib": outside / MIB,
            }

        def _pre_fw_hook(self, module, inputs) -> None:
            # The root module called again in forward: the next micro-batch of the same step
            # (gradient accumulation). Its per-module stats are not read: start them afresh.
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # torch would hook every parameter, and a frozen one refuses a hook: hook only
            # the trainable ones, the way torch does (the gradient made, then accumulated).
            found = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._grad_seen),
                            param.register_post_accumulate_grad_hook(lambda p: self._grad_seen(p.grad)),
                        )
            return found

        def _grad_seen(self, grad: torch.Tensor) -> None:
            if self.failure is None:
                try:
                    self._update_and_maybe_create_winfos(grad, mem_tracker._MemRefType.GRAD)
                except Exception as exc:  # noqa: BLE001 -- as in _guarded
                    self.failure = f"{type(exc).__name__}: {str(exc).strip()[:300]}"

    return PeakTracker()


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

    def __init__(self, device: torch.device, limit_mib: float | None = None):
        self.device = device
        self.limit_mib = limit_mib
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
        tracker = peak_tracker(self.limit_mib)
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
