"""A step's predicted time on a device profile: the fake step's op trace priced, the
strategy's collectives scheduled against it.

- **Compute** (:class:`StepCompute`): the trace's ops (:mod:`~sharded_exp.predict.op_trace`)
  each timed by :func:`sharded_exp.speed.compute.op_time` (plus the profile's per-op
  overhead), summed per unit's forward; the backward (recomputation included) split over
  the units in proportion to their forward; the optimizer phase (clipping and the step) apart.
  The root's forward (embeddings before the units, head and loss after) goes to the first and
  last unit.
- **Communication**: the strategy's time model (:class:`~sharded_exp.strategies.timing.TimeModel`)
  turns the model's units (their parameter and gradient bytes, from the model's shapes) into
  a schedule, priced on the machine's links, played by
  :func:`sharded_exp.speed.schedule.simulate`. On a CPU, whose ranks' threads fill its cores,
  the communication cannot hide under the compute: it takes its time from the same cores
  (:func:`sharded_exp.speed.schedule.on_shared_cores`).
- **MFU**: :func:`sharded_exp.speed.schedule.mfu`: the model's FLOPs per step on one device
  (recomputation not counted) over the step time and the device's peak for the math dtype:
  the definition a trained run's ``mfu_pct`` uses (:func:`sharded_exp.measure.flops.utilisation`).
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from sharded_exp import precision
from sharded_exp.measure.host_malloc import mapped_from
from sharded_exp.predict.op_trace import Trace
from sharded_exp.speed.collectives import Topology
from sharded_exp.speed.compute import OP_KINDS, base_name, op_time, ops_from_records, tensor_bytes
from sharded_exp.speed.profiles import (
    DeviceProfile,
    HostMemory,
    LinkProfile,
    load_device,
    load_link,
    profile_for_device_name,
)
from sharded_exp.speed.schedule import HostStepBytes, Units, accumulated, mfu, on_shared_cores, simulate
from sharded_exp.strategies import offloads_to_host, timing_of, traits_of
from sharded_exp.strategies.timing import Fabric, TimeUnknown

MATH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The profile dtype a precision computes in, by its autocast dtype (fp32 without one)."""


def math_dtype(cfg) -> str:
    """The profile dtype ``cfg``'s matmuls run in (:func:`~sharded_exp.precision.step_precision`)."""
    return MATH_DTYPES.get(precision.compute_dtype(precision.step_precision(cfg)), "fp32")


@dataclass(frozen=True)
class Machine:
    """What a step runs on: the device, its links, and how many GPUs share a node."""

    device: DeviceProfile
    intra: LinkProfile | None
    """None: one GPU, no link (a world of one issues no collective worth a link)."""
    inter: LinkProfile | None = None
    gpus_per_node: int = 8
    host: LinkProfile | None = None
    host_memory: HostMemory | None = None
    """The node's host memory (what a CPU offload's optimizer step runs at); None: not known."""
    shared_cores: bool = False
    """A CPU whose ranks' threads fill its cores (as a CPU rank sets its threads): the
    communication's work runs on the same cores as the compute, so nothing hides under it
    (:func:`~sharded_exp.speed.schedule.on_shared_cores`)."""

    def fabric(self, world_size: int, params: int = 0, host_step: HostStepBytes | None = None, shapes=None) -> Fabric:
        """The fabric of ``world_size`` ranks; ``params`` trainable elements, ``host_step`` and the
        model's ``shapes`` for CPU offload's step on the host."""
        topology = Topology(self.gpus_per_node, self.intra, self.inter)
        pcie = self.host.bandwidth_Bps if self.host is not None else None
        ranks_on_node = min(self.gpus_per_node, max(world_size, 1))
        host = self.host_memory.per_rank(ranks_on_node, self.gpus_per_node) if self.host_memory else None
        page = self.host_memory.fresh_page_s if self.host_memory else None
        tensors = tuple(float(math.prod(shape)) for group in shapes.groups for shape in group) if shapes else ()
        element = float(shapes.element_bytes) if shapes else 4.0
        return Fabric(world_size, topology, pcie, host, params, host_step, tensors, element, page)


@dataclass(frozen=True)
class StepCompute:
    """One step's compute on one device, from its trace: seconds per unit's forward and
    backward, the root's forward before and after the units, the optimizer phase, and the
    model FLOPs of the step (recomputation not counted)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    optimizer_s: float
    model_flops: float
    forward_flops: tuple[float, ...] = ()
    """The forward's FLOPs per unit (the root's with the first and last, as its seconds):
    what a deep model's FLOPs are scaled by. Empty: scaled by the forward's seconds."""

    @property
    def compute_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s) + self.optimizer_s

    def at_depth(self, units: int) -> "StepCompute":
        """The same model with ``units`` identical units (a deep model from a shallow
        trace): the middle units' mean stands for each, the first and last keep the root's
        share; the model's FLOPs scale with the forward's FLOPs (with its seconds where the
        trace has none: time is not proportional to FLOPs where small ops are memory-bound)."""
        have = len(self.forward_s)
        if units == have or have < 3 or units < 3:
            return self
        forward = _deepened(self.forward_s, units)
        backward = _deepened(self.backward_s, units)
        weights = self.forward_flops if sum(self.forward_flops) else self.forward_s
        deeper = _deepened(weights, units)
        scale = sum(deeper) / sum(weights) if sum(weights) else 1.0
        flops = _deepened(self.forward_flops, units) if self.forward_flops else ()
        return replace(self, forward_s=forward, backward_s=backward, model_flops=self.model_flops * scale,
                       forward_flops=flops)  # fmt: skip

    def optimizer_scaled(self, fraction: float) -> "StepCompute":
        """The optimizer phase for a rank that steps ``fraction`` of what the trace stepped."""
        return replace(self, optimizer_s=self.optimizer_s * fraction)


def _deepened(per_unit: tuple[float, ...], units: int) -> tuple[float, ...]:
    """``per_unit`` at ``units`` units: the first and last kept, the middle ones' mean between."""
    middle = sum(per_unit[1:-1]) / (len(per_unit) - 2)
    return (per_unit[0], *[middle] * (units - 2), per_unit[-1])


OUTSIDE_AUTOGRAD = ("zero_", "_foreach_zero_")
"""Ops the trace marks forward that run outside autograd, as the optimizer's do: the gradients
zeroed at the step's start (``trainer.zero_grad=zeros``; ShardedDDP's): priced at the
optimizer's host cost per op (:meth:`DeviceProfile.host_cost_s`), not a forward op's."""


def step_compute(
    trace: Trace,
    device: DeviceProfile,
    model_flops: float,
    math_dtype: str = "fp32",
    sharded_parameters: bool = False,
    malloc: str = "reuse",
    waits_before_step: bool = False,
) -> StepCompute:
    """The trace's compute priced on ``device`` (see the module docstring). Each op costs its
    kernel time and the host's cost per op (:meth:`DeviceProfile.host_cost_s`, for
    ``math_dtype`` in the forward and backward, autocast's, and the optimizer's own, for its
    ops and those :data:`OUTSIDE_AUTOGRAD`; that of
    an FSDP2 step where ``sharded_parameters``, :func:`shards_parameters`): their
    sum where ops run one after the other (CPU); where the host launches ahead of the device
    (CUDA), each op's share of the device's timeline (:func:`launched_ahead`: a launch-bound
    step is the host's time, a compute-bound one the kernels', and a long kernel hides the
    launches of the short ops after it; ``waits_before_step``, :func:`waits_before_step`: the host
    waits for the device before the optimizer phase).
    On a profile that prices new pages (a CPU's ``this``), an op run one after the other also
    pays for the pages of each block it makes that glibc maps anew (:func:`new_pages`; under the
    ranks' ``malloc`` rule, :func:`malloc_rule`: from 4 MiB under ``fixed``, else above 32 MiB)."""
    records = trace.phased()
    mapped = mapped_from(rule=malloc) if device.fresh_page_s and not device.asynchronous else None
    hosts, kernels, kinds = [], [], []
    for record, op in zip(records, ops_from_records(records, "fp32")):
        outside = record["phase"] == "optimizer" or base_name(record["op"]) in OUTSIDE_AUTOGRAD
        host = device.host_cost_s(math_dtype, sharded_parameters, optimizer=outside)
        faults = new_pages(record, mapped) * device.fresh_page_s if mapped else 0.0
        hosts.append(host)
        kernels.append(op_time(op, device) + faults)
        kinds.append(op.kind)
    if device.asynchronous:
        first_step_op = next((i for i, r in enumerate(records) if r["phase"] == "optimizer"), None)
        waits = {first_step_op} if waits_before_step and first_step_op is not None else set()
        seconds = launched_ahead(hosts, kernels, waits)
    else:
        seconds = [h + k for h, k in zip(hosts, kernels)]
    count = max(1, trace.units)
    forward, flops = [0.0] * count, [0.0] * count
    forward_by_kind = {k: [0.0] * count for k in OP_KINDS}
    backward_by_kind = dict.fromkeys(OP_KINDS, 0.0)
    optimizer = 0.0
    seen_unit = False
    for record, kind, s in zip(records, kinds, seconds):
        if record["phase"] == "backward":
            backward_by_kind[kind] += s
        elif record["phase"] == "optimizer":
            optimizer += s
        else:  # a unit's, or the root's: before the first unit (embeddings), else after (head, loss)
            at = record["unit"] if record["unit"] is not None else (-1 if seen_unit else 0)
            seen_unit = seen_unit or record["unit"] is not None
            forward[at] += s
            forward_by_kind[kind][at] += s
            flops[at] += record.get("flops") or 0
    back = split_backward(backward_by_kind, forward_by_kind, count)
    return StepCompute(tuple(forward), back, optimizer, float(model_flops), tuple(flops))


def launched_ahead(hosts: list[float], kernels: list[float], waits: set[int] | frozenset = frozenset()) -> list[float]:
    """Each op's seconds on a device whose host launches ahead of it (CUDA's asynchronous
    launches, one stream): op i's kernel starts once the host has launched it (the host's
    costs of ops 0..i, summed: the host never waits within a step) and the kernel before it has
    ended. An op's share is how far it moves the device's end; the shares sum to the step's
    compute.

    A long kernel then hides the launches of the short ops after it (a 100 us matmul and three
    5 us ops at 25 us of host each: 25 + 100 + 3 x 5 = 140 us, where each op's larger figure,
    summed, said 175); a launch-bound step is the host's costs summed, a compute-bound one its
    kernels'. Before each op in ``waits`` the host waits for the device to finish what it
    launched (a value read from the device: GradScaler's inf check before the optimizer step,
    :func:`waits_before_step`), so that op's launch hides under nothing. Not modelled: the
    launch queue's depth (a host that far ahead blocks until the device catches up, which
    changes the device's timeline only where short ops follow more long kernels than the
    queue holds)."""
    launched = ended = 0.0
    shares = []
    for i, (host, kernel) in enumerate(zip(hosts, kernels)):
        if i in waits:
            launched = max(launched, ended)
        launched += host
        end = max(ended, launched) + kernel
        shares.append(end - ended)
        ended = end
    return shares


def split_backward(backward: dict[str, float], forward: dict[str, list[float]], count: int) -> tuple[float, ...]:
    """The backward's seconds per unit: each op class's backward (matmul, attention, other)
    over the units in proportion to that class's forward (its seconds per unit).

    The backward's ops carry no unit, so a share must be assumed. One share for the whole
    backward (by all ops' forward) gives the first and last units, which hold the root's
    embeddings, head and loss, the backward of a layer's worth of their forward; but a layer's
    backward is a larger multiple of its forward than the head's and the loss's (attention's
    backward, activation checkpointing's recomputation), so the middle units, which stand for
    every layer a deep model has, got too little: Llama 3.1 8B cut to 4 units and deepened to
    8 priced its backward 7.5% below the same model traced at 8 (0.455 against 0.491 s).
    Split class by class, a layer's matmul backward follows its matmuls, its attention
    backward its attention."""
    out = [0.0] * count
    for kind, seconds in backward.items():
        total = sum(forward[kind])
        for i in range(count):
            out[i] += seconds * forward[kind][i] / total if total else seconds / count
    return tuple(out)


def new_pages(record: dict, mapped_from_bytes: int) -> int:
    """The pages of the blocks an op record made that glibc maps anew (at least
    ``mapped_from_bytes``), whole pages with the chunk's 16-byte header. Under ``reuse`` (the
    heap never trimmed) nothing smaller is new pages in a steady state. An upper bound under
    every rule: glibc serves a large request from a free heap chunk (or the heap's top) big
    enough where it has one. Under glibc's dynamic rule the heap's top is also given back and
    faulted in again, which is not counted."""
    page = mmap.PAGESIZE
    return sum(-(-(n + 16) // page) for n in record.get("fresh_bytes", ()) if n >= mapped_from_bytes)


def fresh_pages(trace: Trace, malloc: str) -> int | None:
    """The new pages a CPU rank's step is priced for (:func:`new_pages` over the trace's
    ops), beside which a run records the page faults it measured (``page_faults_per_step``
    per rank); None where the C library is not glibc (not modelled). A run records it only where
    its profile prices a page (``fresh_page_s``)."""
    mapped = mapped_from(rule=malloc)
    return None if mapped is None else sum(new_pages(r, mapped) for r in trace.phased())


def waits_before_step(cfg) -> bool:
    """Whether ``cfg``'s step reads a value from the device before its optimizer step:
    precision 16's GradScaler checks the gradients for infs with ``.item()`` (torch's
    ``GradScaler._maybe_opt_step``), so on a GPU the host waits for the backward to end there.
    Taken at the optimizer phase's first op (the unscaling and clipping before the check
    count as waited for too)."""
    return precision.Precision.of(cfg) is precision.Precision.fp16


def malloc_rule(cfg) -> str:
    """``cfg``'s CPU ranks' malloc rule (``trainer.host_mmap_threshold``; a config without the
    key runs the default, ``reuse``)."""
    return str(OmegaConf.select(cfg, "trainer.host_mmap_threshold", default="reuse"))


def shards_parameters(cfg) -> bool:
    """Whether ``cfg``'s strategy shards the parameters with FSDP2 (its step then pays FSDP2's
    host work per op)."""
    return traits_of(str(cfg.strategy.name)).shards_parameters


def per_step(cfg) -> tuple[int, int | None]:
    """(samples, tokens) one device processes per step (tokens: samples times the model's
    sequence length; None for a model without one)."""
    samples = int(cfg.trainer.batch_size) * micro_batches(cfg)
    seq = OmegaConf.select(cfg.model, "seq_len", default=None) or OmegaConf.select(cfg.data, "seq_len", default=None)
    return samples, (samples * int(seq) if seq else None)


HOST_STEP_SIZES = (2**16, 2**17)
"""The two parameter sizes (elements) :func:`host_step_bytes` steps."""


def _written(func, args, kwargs) -> int:
    """The bytes of the arguments ``func``'s schema says it writes (``mul_``'s self, each tensor of
    ``_foreach_mul_``'s list, an ``out=``); 0 for an op that writes only new tensors."""
    written = 0
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += tensor_bytes(value)
    return written


class _HostBytes(TorchDispatchMode):
    """Counts each op's bytes (inputs read, outputs written), apart for an op that updates a
    tensor in place (its schema writes an argument: ``mul_``, ``_foreach_mul_``, whose written
    bytes are that argument's, a foreach op returning nothing) and an op that writes a new
    tensor. Ops that write nothing (``.item()``) or only alias their inputs (views) are left out."""

    def __init__(self):
        super().__init__()
        self.in_place = self.out_of_place = self.new = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = _written(func, args, kwargs)
        if written:
            self.in_place += tensor_bytes((args, kwargs)) + written
        elif tensor_bytes(out) and not any(r.alias_info is not None for r in func._schema.returns):
            self.out_of_place += tensor_bytes((args, kwargs)) + tensor_bytes(out)
            self.new += tensor_bytes(out)
        return out


def host_step_bytes(cfg) -> HostStepBytes:
    """What ``cfg``'s optimizer step moves per parameter element on the host, as CPU offload
    runs it: its own ops counted, not a formula. A real CPU weight of each of
    :data:`HOST_STEP_SIZES` elements (its gradient set) is stepped twice; the second step (the
    first makes the state) is counted (:class:`_HostBytes`), with the gradients' clipping
    before it where ``trainer.grad_clip`` is on (on the host too: the gradients are there); the
    counts differ between the sizes by the bytes per element (the step counter's and the norm's
    scalar ops cancel). The optimizer is built as an offloaded run builds it, for host tensors
    (:func:`sharded_exp.optim.optimizer_spec` on the CPU: per tensor, torch's choice there,
    unless ``optimizer.foreach=true``). AdamW with decay at torch 2.13, clipped: 76 bytes in
    place, 20 out of place, of which 8 into new tensors (the square root's and the bias
    correction's quotient)."""
    from sharded_exp.optim import optimizer_spec  # lazy: only an offloading point asks

    clip = float(OmegaConf.select(cfg, "trainer.grad_clip", default=0.0) or 0.0)

    def counted(elements: int) -> tuple[int, int, int]:
        layer = torch.nn.Linear(elements, 1, bias=False)  # a 2-D weight: the decayed group, as most of a model
        layer.weight.grad = torch.full_like(layer.weight, 1e-3)
        optimizer = optimizer_spec(cfg.optimizer, layer, torch.device("cpu")).build()  # as an offloaded run's
        optimizer.step()
        with _HostBytes() as moved:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(layer.parameters(), clip)
            optimizer.step()
        return moved.in_place, moved.out_of_place, moved.new

    small, large = HOST_STEP_SIZES
    per_element = [(b - a) / (large - small) for a, b in zip(counted(small), counted(large))]
    return HostStepBytes(*per_element)


def units_of(compute: StepCompute, shapes, param_bpe: float, grad_bpe: float) -> Units:
    """The schedule's units: the trace's times, the model's unit sizes (the root's
    parameters with the first unit: the embeddings' gradients are the backward's last).
    Gradients are the trainable parameters' only (``trainer.freeze``: a frozen parameter
    has none to reduce), parameters all of them (FSDP2 gathers frozen ones too)."""
    blocks = list(shapes.blocks) or [0]
    trainable = list(getattr(shapes, "trainable_blocks", None) or ())
    if len(trainable) != len(blocks):  # not known, or the units were merged: all trainable
        trainable = list(blocks)
    trainable_root = getattr(shapes, "trainable_root", None)
    trainable_root = shapes.root if trainable_root is None else trainable_root
    if len(compute.forward_s) != len(blocks):
        compute = compute.at_depth(len(blocks))
    if len(compute.forward_s) != len(blocks):  # no units traced: the whole model as one
        compute = StepCompute((sum(compute.forward_s),), (sum(compute.backward_s),), compute.optimizer_s, 0.0)
        blocks, trainable = [sum(blocks)], [sum(trainable)]
    elements = [float(n) for n in blocks]
    elements[0] += shapes.root
    with_grads = [float(n) for n in trainable]
    with_grads[0] += trainable_root
    stored = float(shapes.element_bytes)
    tensors = list(getattr(shapes, "trainable_block_tensors", None) or ())
    if len(tensors) == len(with_grads):  # known, and the units as traced: the root's with the first
        tensors[0] += getattr(shapes, "trainable_root_tensors", None) or 0
    else:
        tensors = []
    return Units(
        forward_s=compute.forward_s,
        backward_s=compute.backward_s,
        param_bytes=[n * param_bpe for n in elements],
        grad_bytes=[n * grad_bpe for n in with_grads],
        optimizer_s=compute.optimizer_s,
        tensor_bytes=[math.prod(shape) * param_bpe for group in shapes.groups for shape in group],
        stored_param_bytes=[n * stored for n in elements],
        stored_grad_bytes=[n * stored for n in with_grads],
        tensors_per_unit=tensors,
    )


def trainable_elements(shapes) -> int:
    """The model's trainable parameters (all of them where the shapes do not say)."""
    blocks = getattr(shapes, "trainable_blocks", None)
    root = getattr(shapes, "trainable_root", None)
    if blocks is None or root is None:
        return int(shapes.params)
    return int(sum(blocks) + root)


def predict_step_time(cfg, world_size: int, compute: StepCompute, shapes, machine: Machine) -> dict[str, Any]:
    """One point's step time: compute, communication (all of it, and the exposed part),
    optimizer step, step time, throughput per device and MFU; ``error`` (and nulls) where a
    figure the schedule needs is missing."""
    strategy = cfg.strategy
    model = timing_of(strategy.name)
    name = str(precision.Precision.of(cfg))
    param_bpe = model.param_bytes_per_element(strategy, name, shapes.element_bytes)
    grad_bpe = model.grad_bytes_per_element(strategy, name, shapes.element_bytes)
    units = units_of(compute, shapes, param_bpe, grad_bpe)
    host_step = None
    if offloads_to_host(strategy):  # the optimizer steps on the host (the fake step stepped on the device)
        host_step = host_step_bytes(cfg)
        units = replace(units, optimizer_s=0.0)
    fabric = machine.fabric(world_size, trainable_elements(shapes), host_step, shapes)
    try:
        played = simulate(_step_schedule(model, strategy, units, fabric, micro_batches(cfg)))
        if machine.shared_cores:  # a CPU: gloo's work shares the ranks' cores
            played = on_shared_cores(played)
    except TimeUnknown as exc:
        return {"step_time_s": None, "error": f"{machine.device.name}: {exc}"}
    samples, tokens = per_step(cfg)
    dtype = math_dtype(cfg)
    try:
        peak = machine.device.peak_flops_per_s(dtype)
    except ValueError:
        peak = None
    step = played.step_time_s
    deep = compute.at_depth(len(units.forward_s))
    flops = deep.model_flops if len(deep.forward_s) == len(units.forward_s) else compute.model_flops
    return {
        "compute_s": played.compute_s,
        "comm_s": played.comm_s,
        "exposed_comm_s": played.exposed_s,
        "optimizer_s": units.optimizer_s + played.busy_s.get("host", 0.0),  # on the device, or the host's
        "step_time_s": played.step_time_s,
        "samples_per_s_per_device": samples / step if step else None,
        "tokens_per_s_per_device": tokens / step if step and tokens else None,
        "mfu_pct": mfu(flops, step, peak) if peak and flops and step else None,
        "peak_flops_per_s": peak,  # MFU's denominator; a CPU run's mfu_pct divides by it too
        "profile": machine.device.name,
        "error": None,
    }


def micro_batches(cfg) -> int:
    """The micro-batches of one optimizer step (``trainer.grad_accum``, 1 where unset)."""
    return max(1, int(OmegaConf.select(cfg, "trainer.grad_accum", default=1) or 1))


def _step_schedule(model, strategy, units: Units, fabric: Fabric, micro: int):
    """The strategy's step of ``micro`` micro-batches: the trace's compute shared out over
    them, the earlier ones as the strategy runs a micro-batch that does not synchronise
    gradients, the last (with the optimizer step) as it runs a whole step."""
    price = model.price(strategy, fabric)
    if micro == 1:
        return model.schedule(strategy, units, price, fabric)
    one = units.per_micro_batch(micro)
    earlier = model.micro_batch(strategy, replace(one, optimizer_s=0.0), price, fabric)
    return accumulated([earlier] * (micro - 1) + [model.schedule(strategy, one, price, fabric)])


def rank_threads(local_ranks: int) -> int:
    """The intra-op threads a CPU rank sets, ``local_ranks`` ranks sharing this machine's cores
    (:func:`sharded_exp.launch.rank.run_rank`)."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def ensure_profile(device_type: str, local_ranks: int) -> None:
    """The ``this`` figures :func:`run_step_time` prices a run of ``local_ranks`` ranks on,
    measured now where they are not cached (a new machine: seconds), so that a job measures
    before its ranks start, not beside them. Never raises: a failure is said where the
    prediction is made."""
    try:
        from sharded_exp.measure import machine as this  # lazy: measuring starts processes

        this.this_figures(rank_threads(local_ranks), device=device_type)
    except Exception:  # noqa: BLE001 -- measuring never breaks training
        pass


def run_step_time(
    cfg, world_size: int, device_type: str, est, shapes, prediction, local_world_size: int | None = None
) -> dict[str, Any]:
    """A training run's predicted step time, from its own fake step's trace (``est``: the
    faked rank's :class:`~sharded_exp.predict.fake_step.StepEstimate`), priced on the ``this``
    profile: on CPU with the threads a rank gets, every rank on this machine; on CUDA the GPU
    measured (in a child process), every rank on one node, linked as the device's sourced
    profile states. ``local_world_size``: the ranks on this node (torchrun's or SLURM's;
    default: every rank): a run across nodes is not priced, since a run does not know the
    link between them (the planner's ``plan.inter_node_gbps`` does). Never raises: a
    prediction that cannot be made is ``{"step_time_s": None, "error": why}``."""
    trace = (est.extra or {}).get("trace")
    if trace is None or not trace.records:
        return {"step_time_s": None, "error": f"no op trace ({est.method})"}
    local = world_size if local_world_size is None else max(1, local_world_size)
    if local < world_size:
        return {
            "step_time_s": None,
            "error": f"{world_size} ranks, {local} on this node: the link between nodes is not known to a run "
            "(plan it: sharded-exp-plan plan.inter_node_gbps=... plan.gpus_per_node=...)",
        }
    try:
        from sharded_exp.measure import machine as this  # lazy: measuring starts processes

        extra: dict[str, Any] = {}
        if device_type == "cuda":
            device = this.this_cuda_profile()
            link = sourced_link(device.title, world_size)
            host = this.this_cuda_host_link()
            machine = Machine(device, link, None, max(world_size, 1), host, device.host_memory)
        else:
            threads = rank_threads(local)
            device, link = this.this_profile(threads)
            machine = Machine(device, link, None, world_size, shared_cores=True)  # a CPU run has no offload
            pages = fresh_pages(trace, malloc_rule(cfg)) if device.fresh_page_s else None  # priced only so
            extra = {"threads_per_rank": threads, "fresh_pages_per_step": pages}
        compute = step_compute(
            trace,
            device,
            est.flops_per_step,
            math_dtype(cfg),
            shards_parameters(cfg),
            malloc_rule(cfg),
            waits_before_step(cfg),
        )
        return predict_step_time(cfg, world_size, compute, shapes, machine) | extra
    except Exception as exc:  # noqa: BLE001 -- measuring never breaks training: null and why
        return {
            "step_time_s": None,
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
        }


def sourced_link(title: str, world_size: int) -> LinkProfile | None:
    """The intra-node link of the sourced profile whose device ``title`` names (None for one
    GPU, which has none)."""
    if world_size <= 1:
        return None
    name = profile_for_device_name(title)
    if name is None or "intra_node" not in load_device(name).links:
        raise ValueError(f"no sourced link profile for {title} (the GPUs' link is not measured)")
    return load_link(load_device(name).links["intra_node"])
