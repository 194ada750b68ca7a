"""The fake step's allocations and frees, in order and with their streams, and what torch's
CUDA caching allocator makes of them (:mod:`sharded_exp.predict.allocator`).

A fake step (:mod:`sharded_exp.predict.fake_step`) counts the bytes its tensors hold. A CUDA
run holds more: the caching allocator hands each tensor a rounded block out of a cached
segment, keeps a pool per stream, and delays a block's reuse while a collective on another
stream may still read it. :class:`AllocTrace` records what the allocator would be asked for,
from the same memory tracker the fake step already runs (one event per storage made or
dropped), and :func:`replay` runs it through the allocator model.

The streams, as a CUDA run uses them:

- the default stream: the model's forward, backward and the optimizer step;
- the side streams a strategy enters through its device's stream context
  (``device_handle.stream(s)``; FSDP2's all-gather copy-in, reduce-scatter and HSDP
  all-reduce streams): what is allocated inside one is cached in that stream's pool. The
  strategy's memory model names them in order of their first allocation
  (:attr:`~sharded_exp.strategies.residency.MemoryModel.side_streams`);
- NCCL's stream: a tensor handed to a collective (``torch.distributed``'s functions) is
  used on it (ProcessGroupNCCL's ``recordStream``): freed, it is not reused before that
  stream's work is done, taken as done when the next collective is issued (NCCL runs them
  one after another). A training step ends with the loss read on the host (a device
  synchronisation): every stream's work is then done.
- buffers a strategy replaces in a way the fake step cannot (DDP's bucket rebuild before
  the second forward, :func:`sharded_exp.measure.tracker.reallocated`): the old blocks freed
  and the new ones allocated as the strategy tells (:meth:`AllocTrace.reallocated`);
- the build: a run builds its model on the meta device or in host memory, so the trace
  starts from the tensors then allocated (:meth:`AllocTrace.restart`): as the wrap starts
  where the strategy does not shard parameters (the model moved to the device, then
  wrapped: what the wrap frees stays cached), as the build ends where it does (FSDP
  gathers a unit at a time in host memory).

Two steps are recorded, so the second shows the steady state's caching.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from sharded_exp.measure.tracker import watching_reallocations
from sharded_exp.predict.allocator import Allocator, alloc_conf_from_env, cuda_context_entries, parse_alloc_conf

MIB = 2**20
DEFAULT_STREAM = "default"
NCCL_STREAM = "nccl"
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
)
"""``torch.distributed`` functions whose tensors a NCCL run records on NCCL's stream."""


class AllocTrace:
    """Records ``(op, id, size, stream)`` events for :meth:`Allocator.replay
    <sharded_exp.predict.allocator.Allocator.replay>` from a memory tracker (torch's
    MemTracker: one ``_update_snap`` call per storage added or deleted).

    ``side_streams``: names for the side streams, in order of their first allocation (more
    than named: ``stream <n>``)."""

    def __init__(self, side_streams: tuple[str, ...] = ()):
        self.events: list[tuple] = []
        self.side_streams = tuple(side_streams)
        self._stream = None  # the side stream entered (an object), None: the default stream
        self._names: dict[int, str] = {}
        self._keep: list = []  # the stream objects named, so that their ids stay theirs
        self._ids = itertools.count()
        self._tracker = None
        self._live: dict[int, tuple[int, str]] = {}  # id -> (size, stream) of what is allocated now
        self._held: set[int] | None = None  # the wrapped model's blocks whose frees wait (:meth:`restart`)
        self._frees_held: list[tuple] = []
        self.closed = False
        """Set as the fake step ends (:func:`recording`): a storage its tensors' reference cycles
        kept, freed later by Python's garbage collector, is not appended to a finished trace."""

    # --- what is recorded -----------------------------------------------------------------------
    def attach(self, tracker) -> None:
        """Record every storage ``tracker`` adds or deletes from now on."""
        # lazy: torch's private mem_tracker imports torch._inductor and dynamo (seconds); only a CUDA fake step records
        from torch.distributed._tools.mem_tracker import _UpdateType

        update = tracker._update_snap
        self._tracker = tracker

        def recorded(u_type, winfo, *args, **kwargs):
            if self.closed:
                return update(u_type, winfo, *args, **kwargs)
            # A storage resized (FSDP2 frees and re-allocates its unsharded parameters so)
            # is a free of the old block and, unless now empty, a new allocation.
            if u_type in (_UpdateType.DEL, _UpdateType.SIZE):
                if self._live.pop(getattr(winfo, "alloc_trace_id", None), None):
                    self._free(winfo.alloc_trace_id)
            if u_type == _UpdateType.ADD or (u_type == _UpdateType.SIZE and winfo.mem_consumed > 0):
                self._malloc(winfo)
            return update(u_type, winfo, *args, **kwargs)

        tracker._update_snap = recorded

    def _malloc(self, winfo) -> None:
        winfo.alloc_trace_id = next(self._ids)
        stream = DEFAULT_STREAM if self._stream is None else self._name(self._stream)
        self._live[winfo.alloc_trace_id] = (int(winfo.mem_consumed), stream)
        self.events.append(("malloc", winfo.alloc_trace_id, int(winfo.mem_consumed), stream))

    def _free(self, ident: int) -> None:
        if self._held is not None and ident in self._held:
            self._frees_held.append(("free", ident, 0, None))
        else:
            self.events.append(("free", ident, 0, None))

    def restart(self, hold_frees: bool = False) -> None:
        """The device's trace starts afresh from what is allocated now, in the order it was
        allocated. A run builds its model on the meta device or in host memory
        (sharded_exp/models/materialise.py; FSDP a unit at a time), so the device's allocator
        first sees the model as moved there (a strategy that does not shard: restarted as its
        wrap starts) or the wrapped model's states (FSDP: at the build's end), not the fake
        build's whole-model tensors.

        ``hold_frees``: what the wrap frees of those blocks (fairscale OSS copies each rank's
        trainable parameters into one flat buffer and frees their blocks) is recorded as freed
        when the wrap ends (:meth:`release_held`), after the buffers that replace them are
        allocated, so the allocator holds them all cached. Recorded in turn, a rank's buffer
        could take a block freed before it where that block (one large parameter, or small
        neighbours merged in a shared segment) is as large: where a rank holds one tensor,
        every buffer takes the block the rank before freed and the gradients take new
        segments instead. On a 7B GPT the two orders differ by under 0.4 GiB reserved at 8 and
        64 ranks, but only the held one keeps the trace of a model with a block more the
        shallower one's with a block inserted once ranks outnumber tensors
        (:mod:`sharded_exp.plan.deepen`)."""
        self.events = [("malloc", i, size, stream) for i, (size, stream) in sorted(self._live.items())]
        self._held = set(self._live) if hold_frees else None
        self._frees_held = []

    def release_held(self) -> None:
        """The wrap is over: the frees :meth:`restart` held are recorded, in their order."""
        self.events += self._frees_held
        self._held, self._frees_held = None, []

    def step_end(self) -> None:
        """A training step is over: its loss read on the host, every stream's work done."""
        self.events.append(("sync", None, 0, None))

    def _ids_of(self, tensors) -> list[int]:
        """The trace's ids of the tracked storages among ``tensors``."""
        if self._tracker is None:
            return []
        # lazy: torch's private mem_tracker (as in attach)
        from torch.distributed._tools.mem_tracker import get_untyped_storages

        ids = []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for st in get_untyped_storages(t):
                winfo, _ = self._tracker._WINFO.get(st, (None, None))
                if winfo is not None and hasattr(winfo, "alloc_trace_id"):
                    ids.append(winfo.alloc_trace_id)
        return ids

    def _used_on(self, stream: str, tensors) -> None:
        """Each tracked storage among ``tensors`` is used on ``stream`` as well."""
        for ident in self._ids_of(tensors):
            if ident in self._live:  # a storage given way (:meth:`reallocated`) is no block any more
                self.events.append(("record_stream", ident, 0, stream))

    def reallocated(self, old: list, new_sizes: list[int], old_freed_last: bool) -> None:
        """A strategy's buffers ``old`` replaced by blocks of ``new_sizes`` that the fake step
        does not make (:func:`sharded_exp.measure.tracker.reallocated`: DDP's bucket rebuild):
        ``old`` freed here (its later free, when the fake step drops it, is not recorded
        again), the new blocks allocated on the stream in use and kept to the end."""
        frees = [("free", i, 0, None) for i in self._ids_of(old) if self._live.pop(i, None)]
        if not frees:
            return  # none of them was a block the trace knows: nothing to replace
        stream = DEFAULT_STREAM if self._stream is None else self._name(self._stream)
        mallocs = []
        for size in new_sizes:
            ident = next(self._ids)
            self._live[ident] = (size, stream)
            mallocs.append(("malloc", ident, size, stream))
        self.events += mallocs + frees if old_freed_last else frees + mallocs

    # --- where allocations happen -----------------------------------------------------------------
    def _name(self, stream) -> str:
        """A side stream's name, given at its first allocation (a stream that only
        communicates, FSDP2's all-gather stream, allocates nothing and takes no name)."""
        key = id(stream)
        if key not in self._names:
            n = len(self._names)
            self._names[key] = self.side_streams[n] if n < len(self.side_streams) else f"stream {n + 1}"
            self._keep.append(stream)
        return self._names[key]

    @contextlib.contextmanager
    def streams(self, device_module):
        """While recording, ``device_module.stream(s)`` (the device-agnostic stream context
        strategies use; ``torch.cpu`` in a fake step) files allocations under ``s``, and
        ``torch.distributed``'s collectives record their tensors on NCCL's stream."""
        trace = self

        @contextlib.contextmanager
        def stream(s):
            before = trace._stream
            trace._stream = s
            try:
                yield
            finally:
                trace._stream = before

        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def on_nccl(fn):
            def call(*args, **kwargs):
                tensors = _tensors_in(list(args) + list(kwargs.values()))
                # NCCL runs its collectives one after another on its stream: the one before is
                # taken as done when the next is issued (its blocks reusable from then on).
                trace.events.append(("sync", None, 0, NCCL_STREAM))
                trace._used_on(NCCL_STREAM, tensors)
                return fn(*args, **kwargs)

            return call

        entered = device_module.stream
        device_module.stream = stream
        for name, fn in originals.items():
            setattr(dist, name, on_nccl(fn))
        try:
            with watching_reallocations(self.reallocated):
                yield self
        finally:
            device_module.stream = entered
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _tensors_in(values) -> list:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors_in(v)
    return out


@dataclass(frozen=True)
class AllocatorFigures:
    """What the allocator model makes of one fake step's trace (MiB)."""

    tracked_peak_mib: float
    """The live bytes at their peak, as the fake step counts them (no rounding)."""
    allocated_mib: float
    """Peak ``allocated_bytes.all.peak``: rounded blocks, as torch counts them."""
    reserved_mib: float
    """Peak ``reserved_bytes.all.peak``: the segments cached."""
    fragmentation_mib: float
    """Peak reserved minus peak allocated: what the cache holds beyond the blocks at the peak."""
    segments: int
    streams: tuple[str, ...]
    alloc_conf: str
    """The ``PYTORCH_CUDA_ALLOC_CONF`` replayed ("" for torch's defaults)."""


def replay(events: list, alloc_conf: Optional[str] = None, workspace_bytes: int = 0) -> AllocatorFigures:
    """``events`` through the caching allocator model under ``alloc_conf``, with cuBLAS's
    workspace (``workspace_bytes``, allocated through the caching allocator at the first
    matmul and kept) allocated first. Unlimited memory: the figures say what it would take."""
    allocator = Allocator(parse_alloc_conf(alloc_conf))
    live, peak = 0, 0
    sizes: dict = {}
    for op, ident, size, _ in events:  # the tracked (unrounded) peak, for the differences
        if op == "malloc":
            sizes[ident] = size
            live += size
            peak = max(peak, live)
        elif op == "free":
            live -= sizes.pop(ident, 0)
    head = [("malloc", "cuBLAS workspace", workspace_bytes, DEFAULT_STREAM)] if workspace_bytes else []
    result = allocator.replay(head + list(events))
    streams = tuple(dict.fromkeys(s for op, _, _, s in events if op in ("malloc", "record_stream") and s))
    return AllocatorFigures(
        tracked_peak_mib=(peak + workspace_bytes) / MIB,
        allocated_mib=result.peak_allocated_bytes / MIB,
        reserved_mib=result.peak_reserved_bytes / MIB,
        fragmentation_mib=(result.peak_reserved_bytes - result.peak_allocated_bytes) / MIB,
        segments=result.peak_segments,
        streams=streams,
        alloc_conf=alloc_conf or "",
    )


def context_source(context: dict[str, Any]) -> str:
    """Where a :func:`cuda_context` figure comes from, as a plan's allocator line says it."""
    return f"{context['source']} (torch {context['torch']}, {context['device']}; matched: {context['matched']})"


def cuda_context(device_name: Optional[str] = None, torch_version: Optional[str] = None) -> dict[str, Any]:
    """The CUDA context nvidia-smi shows beside ``reserved_bytes`` (``cuda_context.json``):
    the entry for ``device_name`` and ``torch_version`` (its major.minor) where one is
    published, else the newest torch's published figure of a bare context. Returns
    ``{"mib", "source", "torch", "device", "matched"}``."""
    entries = [e for e in cuda_context_entries() if e.get("context_bytes")]
    version = ".".join((torch_version or torch.__version__).split("+")[0].split(".")[:2])

    def score(e) -> tuple:
        same_device = bool(device_name) and device_name.lower() in str(e.get("device", "")).lower()
        same_torch = str(e.get("torch", "")).startswith(version)
        return (same_device, same_torch, _version_key(e.get("torch", "")))

    best = max(entries, key=score)
    same_device, same_torch, _ = score(best)
    matched = "device and torch" if same_device and same_torch else "device" if same_device else (
        "torch" if same_torch else "none: the newest torch's published figure")  # fmt: skip
    return {
        "mib": best["context_bytes"] / MIB,
        "source": best["source"],
        "torch": best["torch"],
        "device": best["device"],
        "matched": matched,
    }


def _version_key(text: str) -> tuple:
    digits = []
    for part in str(text).split("+")[0].split(" ")[0].split("."):
        if not part.isdigit():
            break
        digits.append(int(part))
    return tuple(digits)


@contextlib.contextmanager
def recording(device_type: str, side_streams: tuple[str, ...] = ()):
    """An :class:`AllocTrace` while a step for ``device_type`` is faked, or None: a CPU run has
    no caching allocator. The fake step's tensors are CPU tensors whatever device it stands
    for: its strategies enter their streams through ``torch.cpu.stream``."""
    if device_type != "cuda":
        yield None
        return
    trace = AllocTrace(side_streams)
    try:
        with trace.streams(torch.cpu):
            yield trace
    finally:
        trace.closed = True


def alloc_conf_of(cfg) -> Optional[str]:
    """The allocator setting a prediction replays: ``plan.alloc_conf`` where the config is a
    plan's and sets one ("" : torch's defaults), else ``PYTORCH_CUDA_ALLOC_CONF`` (or
    ``PYTORCH_ALLOC_CONF``) from this process's environment, as the run's ranks inherit it."""
    plan = OmegaConf.select(cfg, "plan.alloc_conf", default=None) if OmegaConf.is_config(cfg) else None
    return alloc_conf_from_env() if plan is None else str(plan)


def replayable(alloc_conf: Optional[str]) -> bool:
    """Whether ``alloc_conf`` has the caching allocator modelled here (not ``cudaMallocAsync``,
    the driver's pool)."""
    return parse_alloc_conf(alloc_conf).backend == "native"


def point_figures(events: list, alloc_conf: Optional[str], workspace_mib: float) -> Optional[dict[str, Any]]:
    """What a planned point (or a run's prediction) adds to the tensors' peak on CUDA: the
    allocator's rounding (``allocated_extra_mib``: allocated as torch counts it, less the
    tensors' bytes), its cache (``reserved_extra_mib``: reserved less the tensors' bytes),
    the fragmentation at the peak and the CUDA context (nvidia-smi's figure is reserved +
    context). Extras rather than totals: a rank's peak, a host offload or a deeper model
    (sharded_exp.plan.depth) moves the tensors' bytes, and the extras ride on top."""
    if not replayable(alloc_conf):
        return None
    figures = replay(events, alloc_conf, int(round(workspace_mib * MIB)))
    context = cuda_context()
    return {
        "tracked_peak_mib": figures.tracked_peak_mib,
        "allocated_extra_mib": figures.allocated_mib - figures.tracked_peak_mib,
        "reserved_extra_mib": figures.reserved_mib - figures.tracked_peak_mib,
        "fragmentation_mib": figures.fragmentation_mib,
        "segments": figures.segments,
        "streams": list(figures.streams),
        "alloc_conf": figures.alloc_conf,
        "context_mib": context["mib"],
        "context_source": context_source(context),
    }
