"""A strategy's time model (``Strategy.timing``): which collectives it issues in a step, in
what dtype, and how they overlap the compute, as a :class:`~sharded_exp.speed.schedule.Schedule`.

The base class is DDP's: bucketed all-reduce of the gradients during the backward. Each
strategy's module subclasses it with what differs (ZeRO-1 and OSS: a parameter broadcast
after the step; ShardedDDP: a reduce per bucket to its owner; FSDP: all-gathers and
reduce-scatters per unit, HSDP's two levels, CPU offload). The planner and a run's
prediction (:mod:`sharded_exp.predict.step_time`) ask it, never a strategy's name.

Class methods over plain numbers: nothing is built, no process group is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_exp.measure.host_malloc import DYNAMIC_THRESHOLD_MAX
from sharded_exp.precision import compute_bytes
from sharded_exp.speed import collectives, schedule
from sharded_exp.speed.schedule import Price, Schedule, Units

MB = 2**20


@dataclass(frozen=True)
class Fabric:
    """Where a rank's work runs besides its device: the ranks' placement, the host link
    and the host's memory bandwidth (both None where unknown: a schedule that needs them
    says so)."""

    world_size: int
    topology: collectives.Topology
    pcie_Bps: float | None = None
    host_memory_Bps: tuple[float, float] | None = None
    """One rank's (copy, in-place) bytes/s of host memory (:meth:`HostMemory.per_rank
    <sharded_exp.speed.profiles.HostMemory.per_rank>`)."""
    params: int = 0
    """The model's trainable parameters (elements): what a host optimizer step steps."""
    host_step_bytes: schedule.HostStepBytes | None = None
    """What the configured optimizer's step moves per element on the host
    (:func:`sharded_exp.predict.step_time.host_step_bytes`; None: not counted)."""
    tensor_elements: tuple[float, ...] = ()
    """Each trainable parameter tensor's elements (whole): a shard's blocks glibc maps anew."""
    element_bytes: float = 4.0
    """The bytes of a stored element (the optimizer's state is in it)."""
    fresh_page_s: float | None = None
    """The host's cost of a new page (None: not known, not priced)."""


class TimeUnknown(ValueError):
    """A schedule needs a figure the profiles do not have (the message names it)."""


class TimeModel:
    """DDP's: gradients all-reduced in buckets of ``bucket_cap_mb`` during the backward, in
    the parameters' dtype."""

    @classmethod
    def grad_bytes_per_element(cls, cfg, precision_name: str, element_bytes: float) -> float:
        """Bytes per gradient element as reduced (DDP reduces the gradients' own dtype)."""
        return element_bytes

    @classmethod
    def param_bytes_per_element(cls, cfg, precision_name: str, element_bytes: float) -> float:
        """Bytes per parameter element as sent (a broadcast or all-gather of parameters)."""
        return element_bytes

    @classmethod
    def price(cls, cfg, fabric: Fabric) -> Price:
        """``price(kind, nbytes) -> seconds`` for this strategy's groups (flat: every rank)."""
        return collectives.pricer(fabric.world_size, fabric.topology)

    @classmethod
    def schedule(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        return schedule.ddp(units, price, bucket_bytes=float(getattr(cfg, "bucket_cap_mb", 25.0)) * MB)

    @classmethod
    def micro_batch(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        """A micro-batch before the last of a step that accumulates gradients: compute only
        (DDP's ``no_sync``, and every strategy built on it, communicates nothing until the
        last micro-batch's backward). A strategy that communicates in these says so here."""
        return Schedule(tuple(units.segments()))


class ZeRO1Time(TimeModel):
    """DDP's all-reduce, then every rank's updated parameters broadcast from their owner
    (torch's ZeroRedundancyOptimizer: one broadcast per parameter tensor, or one per rank
    with ``parameters_as_bucket_view``)."""

    @classmethod
    def schedule(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        bucket = float(getattr(cfg, "bucket_cap_mb", 25.0)) * MB
        how = "broadcast" if getattr(cfg, "parameters_as_bucket_view", False) else "broadcast_per_tensor"
        return schedule.zero1(units, price, fabric.world_size, how, bucket_bytes=bucket)


class OSSTime(ZeRO1Time):
    """fairscale OSS under DDP: DDP's all-reduce, then OSS's broadcasts (fp16 with
    ``broadcast_fp16``)."""

    @classmethod
    def param_bytes_per_element(cls, cfg, precision_name: str, element_bytes: float) -> float:
        return 2.0 if getattr(cfg, "broadcast_fp16", False) else element_bytes

    @classmethod
    def schedule(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        return schedule.oss(units, price, fabric.world_size, float(getattr(cfg, "bucket_cap_mb", 25.0)) * MB)


class ShardedDDPTime(OSSTime):
    """fairscale ShardedDDP + OSS: a reduce of each bucket (``reduce_buffer_size``
    elements) to its owner during the backward, then OSS's broadcasts. Buckets off (0), or one
    rank (fairscale buckets nothing there: :func:`sharded_exp.strategies.sharded_ddp.bucketed`):
    a reduce per gradient tensor where the tensors are known, else each unit's gradients
    reduced when its backward ends."""

    @classmethod
    def schedule(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        elements = int(getattr(cfg, "reduce_buffer_size", 2**23))
        bucket = elements * 4.0  # float32 gradients: the parameters' dtype, under autocast too
        unbucketed = elements <= 0 or fabric.world_size == 1
        if unbucketed:  # where the tensors are not known: about a unit's gradients at a time
            bucket = min(g for g in units.grads if g > 0) if any(units.grads) else 1.0
        return schedule.sharded_ddp(units, price, fabric.world_size, bucket_bytes=bucket, per_tensor=unbucketed)


class FSDPTime(TimeModel):
    """FSDP2: each unit's parameters all-gathered (prefetched) before its forward and, with
    ``reshard_after_forward``, again before its backward; its gradients reduce-scattered after
    its backward. Parameters travel in ``param_dtype`` (default: the precision's compute
    dtype), gradients in ``reduce_dtype`` (default float32). HSDP (``replicate`` R > 1): the
    collectives run in a shard group of world_size / R ranks, and each reduce-scatter is
    followed by the all-reduce of its shard across the R replicas, priced apart
    (:func:`~sharded_exp.speed.collectives.hsdp_gradient_time`). ``cpu_offload``: the
    host-device copies and the CPU's optimizer step (:func:`~sharded_exp.speed.schedule.offload`)."""

    DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}

    @classmethod
    def param_bytes_per_element(cls, cfg, precision_name: str, element_bytes: float) -> float:
        chosen = getattr(cfg, "param_dtype", None)
        if chosen is not None:
            return cls.DTYPE_BYTES[str(getattr(chosen, "value", chosen))]
        return element_bytes if str(precision_name) == "32" else float(compute_bytes(precision_name))

    @classmethod
    def grad_bytes_per_element(cls, cfg, precision_name: str, element_bytes: float) -> float:
        chosen = getattr(cfg, "reduce_dtype", None)
        return cls.DTYPE_BYTES[str(getattr(chosen, "value", chosen))] if chosen is not None else 4.0

    @classmethod
    def price(cls, cfg, fabric: Fabric) -> Price:
        replicate = max(1, int(getattr(cfg, "replicate", 1)))
        shard = fabric.world_size // replicate
        topology = fabric.topology

        def price(kind: str, nbytes: float) -> float:
            if replicate > 1 and kind == "reduce_scatter":
                return sum(collectives.hsdp_gradient_time(nbytes, shard, replicate, topology))
            if shard == 1:  # the calls of a world of one: in the host's cost per op of an FSDP2
                return 0.0  # step, measured on one (DeviceProfile.sharded_step_op_overhead_s)
            return collectives.group_time(kind, nbytes, shard, topology)

        return price

    @classmethod
    def schedule(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        return cls._step(cfg, units, price, fabric, reduce_gradients=True)

    @classmethod
    def micro_batch(cls, cfg, units: Units, price: Price, fabric: Fabric) -> Schedule:
        """Every micro-batch gathers each unit's parameters again (FSDP2 reshards after each
        backward whether or not gradients are reduced); only the last reduce-scatters."""
        return cls._step(cfg, units, price, fabric, reduce_gradients=False)

    @classmethod
    def _step(cls, cfg, units: Units, price: Price, fabric: Fabric, reduce_gradients: bool) -> Schedule:
        """A micro-batch on the device, or under CPU offload with its copies, and where it
        reduces the gradients the host's optimizer step."""
        reshard = bool(getattr(cfg, "reshard_after_forward", True))
        if not getattr(cfg, "cpu_offload", False):
            return schedule.fsdp2(units, price, reshard_after_forward=reshard, reduce_gradients=reduce_gradients)
        if fabric.pcie_Bps is None:
            raise TimeUnknown("cpu_offload's copies need the host link")
        if reduce_gradients and fabric.host_memory_Bps is None:
            raise TimeUnknown("cpu_offload's host step needs the host's memory bandwidth")
        if reduce_gradients and fabric.host_step_bytes is None:
            raise TimeUnknown("cpu_offload's host step needs the optimizer's bytes per element")
        shard = fabric.world_size // max(1, int(getattr(cfg, "replicate", 1)))
        # the optimizer's ops over this rank's shard, on the host, at its share of the memory bandwidth; the
        # shards whose new tensors glibc maps anew each step (a GPU rank's glibc runs its own dynamic rule)
        mapped = sum(
            n / shard for n in fabric.tensor_elements if n / shard * fabric.element_bytes >= DYNAMIC_THRESHOLD_MAX
        )
        host_s = (
            schedule.host_step_time(
                fabric.params / shard, fabric.host_step_bytes, *fabric.host_memory_Bps, mapped, fabric.fresh_page_s
            )  # fmt: skip
            if reduce_gradients
            else 0.0
        )
        return schedule.offload(
            units, price, shard, fabric.pcie_Bps, host_s, reshard, reduce_gradients=reduce_gradients
        )
