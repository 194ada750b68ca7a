"""A training step as data, one simulator, and how each strategy schedules its communication.

A step is compute **segments** in program order on the compute stream (each unit's forward,
each unit's backward in reverse, the optimizer step) and **events** on other streams: a
collective, a host-device copy, the CPU's optimizer step. An event is issued when a segment
(or an earlier event) ends, runs on its stream after the events before it there (a stream is
a queue, as a CUDA stream or NCCL's communicator is), and may hold a later segment back until
it ends (``before``): the forward of a unit waits for its all-gather, the optimizer step for
the last gradient bucket. :func:`simulate` plays one step and says what it costs:

- ``step_time_s``: when the last segment or event ends;
- ``compute_s``: the segments' sum;
- ``exposed_s``: ``step_time_s - compute_s``, the time the compute stream waits on another
  stream or the step waits for one to drain (the exposed communication, copies and host step).

The strategies below each build their event list from the model's units, as each really
schedules its work (docstrings say what is and is not modelled); ``price(kind, nbytes)``
gives a collective's seconds (:func:`sharded_exp.speed.collectives.pricer`).

    price = pricer(8, Topology(8, load_link("nvlink4")))
    result = simulate(fsdp2(units, price))
"""

from __future__ import annotations

import mmap
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from sharded_exp.errors import ConfigError

Price = Callable[[str, float], float]
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb=25``."""


class ScheduleError(ConfigError):
    """A schedule that cannot run: an unknown or duplicate name, or a wait that can never end."""


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float


@dataclass(frozen=True)
class Event:
    name: str
    kind: str
    """A collective kind, ``h2d``/``d2h`` (host-device copies) or ``host_step``."""
    seconds: float
    after: str | None
    """The segment or earlier event whose end issues it; None: the step's start."""
    before: str | None = None
    """The segment that cannot start until it ends; None: only the step's end waits."""
    stream: str = "comm"
    nbytes: float = 0.0


@dataclass(frozen=True)
class Schedule:
    segments: tuple[Segment, ...]
    events: tuple[Event, ...] = ()

    def __post_init__(self):
        seen: dict[str, int] = {}
        for i, seg in enumerate(self.segments):
            if seg.name in seen:
                raise ScheduleError(f"two segments named {seg.name!r}")
            if seg.seconds < 0:
                raise ScheduleError(f"segment {seg.name!r} has negative time {seg.seconds}")
            seen[seg.name] = i
        events: set[str] = set()
        for e in self.events:
            if e.name in seen or e.name in events:
                raise ScheduleError(f"the name {e.name!r} is used twice")
            if e.seconds < 0:
                raise ScheduleError(f"event {e.name!r} has negative time {e.seconds}")
            if e.after is not None and e.after not in seen and e.after not in events:
                raise ScheduleError(
                    f"event {e.name!r} is issued after {e.after!r}, which is neither a segment nor an earlier event"
                )
            if e.before is not None and e.before not in seen:
                raise ScheduleError(f"event {e.name!r} holds back {e.before!r}, which is not a segment")
            events.add(e.name)


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float
    exposed_s: float
    """Step time beyond compute: what communication, copies and the host step add."""
    busy_s: dict[str, float]
    """Seconds each non-compute stream was busy (its events' sum)."""
    spans: dict[str, tuple[float, float]] = field(repr=False, default_factory=dict)
    """(start, end) of every segment and event."""

    @property
    def comm_s(self) -> float:
        """All collectives' seconds (the ``comm`` stream), hidden or not."""
        return self.busy_s.get("comm", 0.0)


def simulate(schedule: Schedule) -> StepTime:
    """Play one step of ``schedule`` (see the module docstring); deterministic."""
    segments, events = schedule.segments, schedule.events
    queues: dict[str, list[int]] = defaultdict(list)
    position = {}  # an event's place in its stream's queue
    for i, e in enumerate(events):
        position[i] = len(queues[e.stream])
        queues[e.stream].append(i)
    done = {s: 0 for s in queues}  # how many of a stream's events have a known end
    spans: dict[str, tuple[float, float]] = {}
    by_name = {e.name: i for i, e in enumerate(events)}

    def end_of(name: str, waiting: str) -> float:
        if name in spans:
            return spans[name][1]
        if name in by_name:
            resolve(by_name[name], waiting)
            return spans[name][1]
        raise ScheduleError(f"{waiting} waits for {name!r}, which cannot end first: the schedule deadlocks")

    def resolve(index: int, waiting: str) -> None:
        stream = events[index].stream
        queue = queues[stream]
        while done[stream] <= position[index]:
            e = events[queue[done[stream]]]
            ready = 0.0 if e.after is None else end_of(e.after, waiting)
            if done[stream]:
                ready = max(ready, spans[events[queue[done[stream] - 1]].name][1])
            spans[e.name] = (ready, ready + e.seconds)
            done[stream] += 1

    held: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if e.before is not None:
            held[e.before].append(i)
    t = 0.0
    for seg in segments:
        start = t
        for i in held[seg.name]:
            resolve(i, f"segment {seg.name!r}")
            start = max(start, spans[events[i].name][1])
        spans[seg.name] = (start, start + seg.seconds)
        t = start + seg.seconds
    for i in range(len(events)):
        resolve(i, "the step's end")
    step = max([t] + [spans[e.name][1] for e in events])
    compute = sum(s.seconds for s in segments)
    busy: dict[str, float] = defaultdict(float)
    for e in events:
        busy[e.stream] += e.seconds
    return StepTime(step, compute, step - compute, dict(busy), spans)


def on_shared_cores(played: StepTime) -> StepTime:
    """The step where the other streams' work takes its time from the compute's own cores (a
    CPU whose ranks' threads fill every core, as a CPU rank sets its threads: gloo's copies and
    reductions run on the same cores as the step's ops). Work is conserved: the step takes at
    least its compute plus every other stream's busy time, whatever overlap the schedule
    allows, and longer where a wait in the schedule says so."""
    floor = played.compute_s + sum(played.busy_s.values())
    if played.step_time_s >= floor:
        return played
    return replace(played, step_time_s=floor, exposed_s=floor - played.compute_s)


def accumulated(micro_batches: Sequence[Schedule]) -> Schedule:
    """One optimizer step of several micro-batches (``trainer.grad_accum``), in program order:
    each micro-batch's schedule after the one before, the last as the strategy schedules a
    step of one micro-batch, the earlier ones as it schedules a micro-batch that does not
    synchronise gradients (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``,
    which still gathers parameters; :meth:`~sharded_exp.strategies.timing.TimeModel.micro_batch`).
    An earlier micro-batch's names get a ``mb{i}/`` prefix, and an event it issues at its start
    (``after`` None) is issued when the micro-batch before it ends; the last keeps its names."""
    if not micro_batches:
        raise ScheduleError("a step needs at least one micro-batch")
    segments: list[Segment] = []
    events: list[Event] = []
    for i, one in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        rename = (lambda name: name) if last else (lambda name, tag=f"mb{i}/": name and tag + name)
        start = segments[-1].name if segments else None
        segments += [Segment(rename(seg.name), seg.seconds) for seg in one.segments]
        events += [
            replace(
                e, name=rename(e.name), after=rename(e.after) if e.after is not None else start, before=rename(e.before)
            )  # fmt: skip
            for e in one.events
        ]
    return Schedule(tuple(segments), tuple(events))


def mfu(flops_per_step: float, step_time_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization, in percent: ``100 * flops_per_step / (step_time_s * peak_flops)``.

    - ``flops_per_step``: the model's FLOPs for one optimizer step on one device: forward and
      backward of every sample this device processes in the step (all its micro-batches),
      each counted once. Recomputation by activation checkpointing is not counted (counting it
      gives hardware FLOPs utilization, HFU), nor the optimizer's elementwise work. This is
      the PaLM paper's definition (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling
      with Pathways", Appendix B, https://arxiv.org/abs/2204.02311).
    - ``step_time_s``: wall time of that step.
    - ``peak_flops``: the device's dense peak FLOP/s for the math dtype, from its datasheet
      (:meth:`sharded_exp.speed.profiles.DeviceProfile.peak_flops_per_s`), not a measured rate.
    """
    if step_time_s <= 0 or peak_flops <= 0:
        raise ConfigError(f"MFU needs a positive step time and peak, not {step_time_s} s and {peak_flops} FLOP/s")
    return 100.0 * flops_per_step / (step_time_s * peak_flops)


# ------------------------------------------------------------------ strategies' schedules
@dataclass(frozen=True)
class Units:
    """A model as its units (FSDP's wrapping units, DDP's parameters grouped the same way),
    in forward order, with the times and sizes the schedules need."""

    forward_s: Sequence[float]
    backward_s: Sequence[float]
    param_bytes: Sequence[float]
    """Each unit's full (unsharded) parameters, in the dtype they are communicated in."""
    grad_bytes: Sequence[float] | None = None
    """Each unit's full gradients as reduced (default: ``param_bytes``)."""
    optimizer_s: float = 0.0
    """The optimizer step on this rank's device (a sharded optimizer: its shard's)."""
    tensor_bytes: Sequence[float] = ()
    """Each parameter tensor the optimizer steps, in the dtype it is communicated in (empty:
    not known). A strategy that sends parameters one tensor at a time pays a call for each."""
    stored_param_bytes: Sequence[float] | None = None
    """Each unit's parameters in the dtype they are stored in (default: ``param_bytes``). FSDP2's
    CPU offload copies a shard to the device in this dtype and casts it there for the gather."""
    stored_grad_bytes: Sequence[float] | None = None
    """Each unit's gradients in the parameters' stored dtype (default: :attr:`grads`): FSDP2
    casts the reduce-scattered shard back to it before CPU offload copies it to the host."""
    tensors_per_unit: Sequence[int] = ()
    """Each unit's parameter tensors that take a gradient (empty: not known): the calls a
    strategy that reduces each gradient tensor on its own makes for the unit."""

    def __post_init__(self):
        k = len(self.forward_s)
        grads = self.param_bytes if self.grad_bytes is None else self.grad_bytes
        if k == 0 or not (len(self.backward_s) == len(self.param_bytes) == len(grads) == k):
            raise ConfigError("units need one forward time, backward time and size each (and at least one unit)")

    @property
    def grads(self) -> Sequence[float]:
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def stored_params(self) -> Sequence[float]:
        return self.param_bytes if self.stored_param_bytes is None else self.stored_param_bytes

    @property
    def stored_grads(self) -> Sequence[float]:
        return self.grads if self.stored_grad_bytes is None else self.stored_grad_bytes

    def per_micro_batch(self, micro_batches: int) -> "Units":
        """One of ``micro_batches`` equal micro-batches of this step: its forward and backward
        seconds shared out evenly (the trace times the step's every micro-batch), the sizes
        and the optimizer step as they are (the step runs once, after the last)."""
        if micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, not {micro_batches}")
        return replace(
            self,
            forward_s=[t / micro_batches for t in self.forward_s],
            backward_s=[t / micro_batches for t in self.backward_s],
        )

    def segments(self) -> list[Segment]:
        k = len(self.forward_s)
        return (
            [Segment(f"fwd:{i}", self.forward_s[i]) for i in range(k)]
            + [Segment(f"bwd:{j}", self.backward_s[j]) for j in reversed(range(k))]
            + [Segment("step", self.optimizer_s)]
        )


def _buckets(units: Units, bucket_bytes: float) -> list[tuple[str, float]]:
    """(segment after which the bucket is ready, bytes), in backward order: gradients fill
    buckets of ``bucket_bytes`` as the backward produces them, a unit at a time; the rest goes
    in a last bucket, ready after the last backward segment."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be positive, not {bucket_bytes}")
    buckets, filled = [], 0.0
    for j in reversed(range(len(units.forward_s))):
        filled += units.grads[j]
        while filled >= bucket_bytes:
            buckets.append((f"bwd:{j}", bucket_bytes))
            filled -= bucket_bytes
    if filled > 0:
        buckets.append(("bwd:0", filled))
    return buckets


def ddp(units: Units, price: Price, bucket_bytes: float = DDP_BUCKET_BYTES) -> Schedule:
    """DDP: each gradient bucket is all-reduced as soon as the backward fills it, on the
    communication stream, overlapping the rest of the backward; the optimizer step waits for
    all of them. What the remaining backward cannot hide is exposed, the last bucket at least
    (nothing computes after it).

    Not modelled: the buckets' parameter-level (not unit-level) filling order (a bucket closes
    at the parameter that takes it to ``bucket_cap_mb`` or past it). DDP makes no smaller first
    bucket here: its 1 MiB first bucket is only for a DDP built without ``bucket_cap_mb``,
    which this project always passes (strategies/ddp.py, ``_rebuild_limits``)."""
    events = [
        Event(f"all_reduce:{b}", "all_reduce", price("all_reduce", size), after=seg, before="step", nbytes=size)
        for b, (seg, size) in enumerate(_buckets(units, bucket_bytes))
    ]
    return Schedule(tuple(units.segments()), tuple(events))


def _prefetch_point(segments: list[Segment], index: int) -> str | None:
    """Where a prefetched collective for segment ``index`` is issued: when the segment before
    it starts (the end of the one before that), as FSDP2 issues the next unit's all-gather
    before running the current unit's compute."""
    return segments[index - 2].name if index >= 2 else None


def fsdp2(units: Units, price: Price, reshard_after_forward: bool = True, reduce_gradients: bool = True) -> Schedule:
    """FSDP2 (``fully_shard``): each unit's parameters are all-gathered before its forward,
    the next unit's all-gather issued while the current unit computes (prefetch); with
    ``reshard_after_forward`` they are gathered again, with the same prefetch, before the
    unit's backward; each unit's gradients are reduce-scattered after its backward,
    overlapping the backward of the units before it. All-gathers and reduce-scatters share
    one link: one stream here, in issue order.

    The last unit, resharded at the end of the forward, is gathered again at once and waits:
    FSDP2's default. (torchtitan sets ``reshard_after_forward=False`` on its last block to
    skip that; not modelled.) Not modelled either: the root module's parameters outside the
    units.

    ``reduce_gradients=False``: a micro-batch before the last of a step that accumulates
    gradients (``set_requires_gradient_sync(False)``): the same gathers, since the parameters
    are resharded after each backward as after each forward, and no reduce-scatter."""
    segments = units.segments()
    index = {s.name: i for i, s in enumerate(segments)}
    events: list[tuple[int, Event]] = []  # (issue position, event)

    def gather(unit: int, target: str, tag: str) -> None:
        after = _prefetch_point(segments, index[target])
        if tag == "bwd" and (after is None or index[after] < index[f"fwd:{unit}"]):
            after = f"fwd:{unit}"  # a unit is re-gathered only once its forward has resharded it
        size = units.param_bytes[unit]
        event = Event(f"all_gather:{tag}:{unit}", "all_gather", price("all_gather", size), after, target, nbytes=size)
        events.append((index[after] if after else -1, event))

    k = len(units.forward_s)
    for i in range(k):
        gather(i, f"fwd:{i}", "fwd")
    for j in reversed(range(k)):
        if reshard_after_forward:
            gather(j, f"bwd:{j}", "bwd")
        if not reduce_gradients:
            continue
        size = units.grads[j]
        rs = Event(
            f"reduce_scatter:{j}", "reduce_scatter", price("reduce_scatter", size), f"bwd:{j}", "step", nbytes=size
        )
        events.append((index[f"bwd:{j}"], rs))
    events.sort(key=lambda pair: pair[0])  # stable: program order among events issued together
    return Schedule(tuple(segments), tuple(e for _, e in events))


def fsdp_grad_op(units: Units, price: Price) -> Schedule:
    """FSDP with ``SHARD_GRAD_OP`` (FSDP2: ``reshard_after_forward=False``): parameters stay
    gathered from forward to backward, so there is no re-gather in backward."""
    return fsdp2(units, price, reshard_after_forward=False)


def _param_sync(units: Units, price: Price, world_size: int, how: str) -> list[Event]:
    """The parameters the optimizer stepped, sent from their owners after the step: the
    optimizer's tensors where known (frozen parameters are neither stepped nor sent), else
    every unit's parameters."""
    total = float(sum(units.tensor_bytes) if units.tensor_bytes else sum(units.param_bytes))
    if how == "all_gather":
        return [Event("all_gather:params", "all_gather", price("all_gather", total), "step", nbytes=total)]
    if how == "broadcast":
        share = total / world_size
        return [
            Event(f"broadcast:{r}", "broadcast", price("broadcast", share), "step", nbytes=share)
            for r in range(world_size)
        ]
    if how == "broadcast_per_tensor":
        if not units.tensor_bytes:  # the tensors are not known: one call per rank
            return _param_sync(units, price, world_size, "broadcast")
        return [
            Event(f"broadcast:{i}", "broadcast", price("broadcast", float(size)), "step", nbytes=float(size))
            for i, size in enumerate(units.tensor_bytes)
        ]
    raise ConfigError(f"param_sync must be 'broadcast', 'broadcast_per_tensor' or 'all_gather', not {how!r}")


def zero1(
    units: Units, price: Price, world_size: int, param_sync: str = "broadcast", bucket_bytes: float = DDP_BUCKET_BYTES
) -> Schedule:
    """ZeRO-1 (torch's ``ZeroRedundancyOptimizer``) and fairscale's OSS under DDP: DDP's
    bucketed all-reduce during backward, each rank steps its shard of the optimizer
    (``units.optimizer_s``: the shard's time), then every rank's updated parameters are sent
    to all: ``world_size`` broadcasts of a 1/world_size share each (``param_sync="broadcast"``:
    OSS's flat buffer per rank, ZeroRedundancyOptimizer's with ``parameters_as_bucket_view``),
    one broadcast per parameter tensor (``"broadcast_per_tensor"``: ZeroRedundancyOptimizer's
    default, ``_broadcast_params_from_rank`` in torch 2.13, each call paying the link's
    latency), or one all-gather. Nothing computes after the step, so the parameter sync is
    exposed whole."""
    base = ddp(units, price, bucket_bytes)
    return Schedule(base.segments, base.events + tuple(_param_sync(units, price, world_size, param_sync)))


def oss(units: Units, price: Price, world_size: int, bucket_bytes: float = DDP_BUCKET_BYTES) -> Schedule:
    """fairscale OSS + DDP: :func:`zero1` with broadcasts."""
    return zero1(units, price, world_size, "broadcast", bucket_bytes)


def sharded_ddp(
    units: Units, price: Price, world_size: int, bucket_bytes: float = DDP_BUCKET_BYTES, per_tensor: bool = False
) -> Schedule:
    """fairscale ShardedDDP + OSS: during backward each gradient bucket is reduced to the rank
    that owns those parameters (a ``reduce``, 1x the bytes where all-reduce moves 2(n-1)/n x),
    the owner steps its shard, then broadcasts its parameters to all after the step (exposed).
    ``per_tensor``: no buckets (``reduce_buffer_size=0``, or one rank, where fairscale makes
    none): one reduce per gradient tensor (:func:`_per_tensor_grads`), each call paying its
    price.

    Not modelled: buckets formed per owner rank (here the backward's buckets, each reduced to
    one owner)."""
    found = _per_tensor_grads(units) if per_tensor else []
    ready = found or _buckets(units, bucket_bytes)
    events = [
        Event(f"reduce:{b}", "reduce", price("reduce", size), after=seg, before="step", nbytes=size)
        for b, (seg, size) in enumerate(ready)
    ]
    return Schedule(tuple(units.segments()), tuple(events) + tuple(_param_sync(units, price, world_size, "broadcast")))


def _per_tensor_grads(units: Units) -> list[tuple[str, float]]:
    """(segment after which it is ready, bytes as reduced) for each gradient tensor, in backward
    order: a unit's tensors (:attr:`Units.tensors_per_unit`) when its backward ends, its
    gradients shared evenly between them (the calls are what the count sets; the bytes sum to
    the unit's). Empty where the tensors are not known."""
    counts = list(units.tensors_per_unit)
    if len(counts) != len(units.grads):
        return []
    return [
        (f"bwd:{j}", units.grads[j] / counts[j])
        for j in reversed(range(len(counts)))
        for _ in range(counts[j])
        if units.grads[j] > 0
    ]


@dataclass(frozen=True)
class HostStepBytes:
    """The bytes per parameter element an optimizer's step on the host moves, counted from its
    ops (:func:`sharded_exp.predict.step_time.host_step_bytes`): in ops that update a tensor in
    place, and in ops that write a new one (each counted as its inputs read plus its output
    written)."""

    in_place: float
    out_of_place: float
    new_tensors: float = 0.0
    """Of ``out_of_place``, the bytes written into new tensors (the square root's): one block
    per parameter tensor and op, each the size of that tensor's state."""


def host_step_time(
    elements: float,
    moved: HostStepBytes,
    copy_Bps: float,
    in_place_Bps: float,
    mapped_elements: float = 0.0,
    fresh_page_s: float | None = None,
) -> float:
    """The CPU optimizer step's seconds over ``elements``, as memory-bound: its in-place bytes at
    the rate an in-place update reaches on the host, the rest at a copy's (one rank's shares,
    :meth:`sharded_exp.speed.profiles.HostMemory.per_rank`); and, where the host's cost of a
    new page is known, the new tensors of the ``mapped_elements`` whose blocks glibc maps anew
    each step (:func:`sharded_exp.measure.host_malloc.mapped_from`), each page at
    ``fresh_page_s`` (None: not priced)."""
    if copy_Bps <= 0 or in_place_Bps <= 0:
        raise ConfigError(f"the host's memory rates must be positive, not {copy_Bps} and {in_place_Bps}")
    seconds = elements * (moved.in_place / in_place_Bps + moved.out_of_place / copy_Bps)
    if fresh_page_s:
        seconds += mapped_elements * moved.new_tensors / mmap.PAGESIZE * fresh_page_s
    return seconds


def offload(
    units: Units,
    price: Price,
    world_size: int,
    pcie_Bps: float,
    host_step_s: float,
    reshard_after_forward: bool = True,
    reduce_gradients: bool = True,
) -> Schedule:
    """FSDP2 with ``CPUOffloadPolicy``: parameters and gradients live on the host. Before each
    all-gather its rank's parameter shard is copied host to device (``copy`` stream, PCIe) in
    its stored dtype (``units.stored_params``: FSDP2 casts to the gather's dtype on the device);
    after each reduce-scatter the gradient shard, cast back to that dtype
    (``units.stored_grads``), is copied device to host; the optimizer steps
    on the CPU (``host`` stream, ``host_step_s``, see :func:`host_step_time`) once the last
    gradient has arrived; the step ends when it does. ``units.optimizer_s`` should be 0 (no
    device step).

    Not modelled: pinned versus pageable memory (the copies are at ``pcie_Bps``), and the host
    step overlapping the next step's forward (it does not in FSDP2: the forward needs the
    updated parameters). ``reduce_gradients=False``: a micro-batch before the last (see
    :func:`fsdp2`): its copies in and gathers, no gradient leaves the device, no host step."""
    if pcie_Bps <= 0:
        raise ConfigError(f"the PCIe bandwidth must be positive, not {pcie_Bps}")
    base = fsdp2(units, price, reshard_after_forward, reduce_gradients)
    events: list[Event] = []
    for e in base.events:
        unit = int(e.name.rsplit(":", 1)[1])
        if e.kind == "all_gather":
            share = units.stored_params[unit] / world_size
            h2d = Event(f"h2d:{e.name}", "h2d", share / pcie_Bps, e.after, stream="copy", nbytes=share)
            events += [h2d, Event(e.name, e.kind, e.seconds, h2d.name, e.before, e.stream, e.nbytes)]
        else:
            share = units.stored_grads[unit] / world_size
            events += [e, Event(f"d2h:{e.name}", "d2h", share / pcie_Bps, e.name, stream="copy", nbytes=share)]
    if not reduce_gradients:
        return Schedule(base.segments, tuple(events))
    last_copy = [e.name for e in events if e.kind == "d2h"][-1]
    events.append(Event("host_step", "host_step", host_step_s, last_copy, stream="host"))
    return Schedule(base.segments, tuple(events))
