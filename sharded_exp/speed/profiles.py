"""Device and link profiles: the figures the time model prices work with, read from data files.

Each GPU and each interconnect is one YAML file in ``profile_data/``. Every figure in a file
is a mapping ``{value, source, note?}`` whose ``source`` names an entry of the file's
``sources`` (a title and a URL: a datasheet, a vendor page, a published micro-benchmark). The
loader refuses a figure without a source, a source without a title or URL, and an unknown
field, so a number cannot slip in unexplained. Where no source was found a figure is left
out, and asking for it is an error that says so (:class:`ProfileError`), never a guess.

Units follow the datasheets: GB = 1e9 bytes, GB/s = 1e9 bytes/s, TFLOP/s = 1e12 FLOP/s. The
dataclasses hold SI values (bytes, bytes/s, FLOP/s, seconds).

    from sharded_exp.speed.profiles import load_device, load_link, network_link
    h100 = load_device("h100_sxm"); h100.matmul_flops_per_s("bf16")   # 792.2e12: MAMF-measured
    load_link("nvlink4").bandwidth_Bps                                  # 370e9: 450 a direction at NCCL's 0.822
    network_link(100).bandwidth_Bps                                     # 12.5e9
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

import yaml

from sharded_exp.errors import ConfigError

DTYPES = ("fp32", "tf32", "fp16", "bf16")
"""The dtypes a device profile may give a peak for (matmul math mode, not storage)."""
OP_CLASSES = ("matmul", "attention")
"""Op classes a profile may give a measured curve for."""
ATTENTION_PASSES = ("forward", "backward")
"""The passes a profile gives a fused attention kernel's fraction of the peak for."""
LINK_CLASSES = ("nvlink", "pcie", "network")


class ProfileError(ConfigError):
    """A profile file that breaks the rules above, an unknown profile name, or a figure the
    profile does not have (the message names what is missing and what there is)."""


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    url: str


@dataclass(frozen=True)
class Figure:
    """One sourced number, in the file's unit (GB, GB/s, TFLOP/s, us or a fraction)."""

    value: float
    source: Source
    note: str = ""


@dataclass(frozen=True)
class Curve:
    """A measured size dependence: (FLOPs of one op, achieved TFLOP/s) points, sorted by
    FLOPs; read in log-log space by :func:`sharded_exp.speed.compute.achieved_flops_per_s`."""

    points: tuple[tuple[float, float], ...]
    source: Source
    note: str = ""
    causal_calls: bool = False
    """An attention curve measured on causal calls, its FLOPs counted over the whole square
    (:func:`sharded_exp.measure.machine.measure_attention`): a call that is not causal takes
    twice its time. False for a matmul's curve standing in for attention's."""


WRITE_ALLOCATE = 2 / 3
"""A copy's counted rate (read plus write) as a fraction of the memory's: a store to a line not
in the cache reads the line first (read for ownership, as x86 caches allocate on a write; only
non-temporal stores skip it), so a copy's two counted bytes are three of the memory's. An
in-place update's line is read anyway: its counted bytes are the memory's."""


@dataclass(frozen=True)
class HostMemory:
    """A node's host memory as CPU offload's optimizer step meets it: the GB/s a copy and an
    in-place update move (each counted as its bytes read plus written, as the op trace counts
    them), for the whole node, and the sockets it is split over."""

    copy: Figure
    in_place: Figure
    sockets: int = 1
    capacity_gib: Figure | None = None
    """The server's memory (GiB; DIMMs are sized in binary units): what a node's CPU-offloaded
    states are held against (``fits``). None: not stated."""
    fresh_page_s: float | None = None
    """Seconds a new page costs the host when first written (measured on a GPU's host; no
    named server states one: None, not priced)."""

    def per_rank(self, ranks_on_node: int, gpus_per_node: int) -> tuple[float, float]:
        """(copy, in-place) bytes/s one rank gets while ``ranks_on_node`` ranks step on the host
        at once (CPU offload: every rank steps after the same backward). Each socket serves the
        GPUs attached to it, filled in order (a DGX's GPUs 0-3 on one socket, 4-7 on the other),
        so a rank shares its socket's figure with the ranks beside it."""
        per_socket = max(1, -(-max(1, gpus_per_node) // self.sockets))
        sharing = max(1, min(ranks_on_node, per_socket))
        scale = 1e9 / self.sockets / sharing
        return self.copy.value * scale, self.in_place.value * scale


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    title: str
    memory: Figure
    """GB of device memory, as the datasheet writes it. Warning: what the driver reports and
    a process can allocate differs from the marketing figure; a fit check should use a
    measured or stated capacity where it has one."""
    memory_bandwidth: Figure
    """GB/s of device (HBM) memory bandwidth."""
    peak_tflops: Mapping[str, Figure]
    """Dense peak TFLOP/s per dtype (no sparsity)."""
    memory_bandwidth_fraction: Figure | None = None
    """The fraction of :attr:`memory_bandwidth` a large device copy reached where one was
    measured (None: the datasheet's figure is used whole, an upper bound)."""
    achievable_fraction: Mapping[str, Figure] = field(default_factory=dict)
    """Per dtype, the fraction of the peak a published matmul micro-benchmark reached."""
    curves: Mapping[tuple[str, str], Curve] = field(default_factory=dict)
    """(op class, dtype) -> measured curve."""
    layout_curves: Mapping[tuple[str, str], Curve] = field(default_factory=dict)
    """(layout, dtype) -> measured curve of a 2-D matmul whose operands are read in that layout
    (``nt``: a linear layer's forward ``x @ W^T``; ``nn``: its input's gradient; ``tn``: its
    weight's gradient, summed over the tokens), tall and read from memory as a training step's
    are (:func:`sharded_exp.measure.machine.measure_matmul_layouts`). Where present it prices
    such a matmul in place of the ``matmul`` curve. Only the ``this`` profile of a CPU has them."""
    attention_fraction: Mapping[tuple[str, str], Figure] = field(default_factory=dict)
    """(pass, dtype) -> the fraction of the peak a fused attention kernel reached in a published
    micro-benchmark (FlashAttention's papers), of the FLOPs it does (a causal one's halved)."""
    links: Mapping[str, str] = field(default_factory=dict)
    """The link profiles this device's GPUs use: ``intra_node`` (between GPUs of a node) and
    ``host`` (to the host), by name, as its datasheet states them."""
    op_overhead_s: float = 0.0
    """Seconds each op costs beyond its roofline (dispatch and launch): measured for the
    ``this`` profile, where it dominates small ops; 0 for a named GPU (launches overlap the
    kernels before them)."""
    step_op_overhead_s: Mapping[str, float] = field(default_factory=dict)
    """Per math dtype (``fp32``; ``bf16``/``fp16`` under autocast), the host's seconds per op of a
    training step's forward and backward (the module calls, autograd's engine, autocast's
    casts), measured on a tiny model's where every op is that cost and no work
    (:func:`sharded_exp.measure.machine.measure_step_op_overhead`). Where present it replaces
    :attr:`op_overhead_s` for a training step's ops; the optimizer's are priced at
    :attr:`optimizer_op_overhead_s` where that is measured (a profile without it measured this
    figure over the whole step, optimizer included)."""
    sharded_step_op_overhead_s: Mapping[str, float] = field(default_factory=dict)
    """The same per-op figure for a step whose parameters FSDP2 shards (``fully_shard``: its
    hooks around each unit, the all-gathers' copy-in and copy-out, each op on DTensors
    dispatched through DTensor's Python layer; the optimizer's at
    :attr:`sharded_optimizer_op_overhead_s`), measured on the same tiny model
    sharded per layer at world size 1 (:func:`sharded_exp.measure.machine.measure_step_op_overhead`).
    Where present it replaces :attr:`step_op_overhead_s` for such a step."""
    optimizer_op_overhead_s: float | None = None
    """The host's seconds per op of the optimizer's step (fp32, outside autograd), measured on
    the same tiny model's Adam step alone (:func:`sharded_exp.measure.machine.measure_optimizer_op_overhead`).
    Where present it prices the optimizer phase's ops, and :attr:`step_op_overhead_s` was
    measured on the forward and backward alone: on a 2-core CPU about 5 us an optimizer op
    against about 22 a forward or backward op (autograd's engine and the module calls). None
    (a profile measured before 2026-12-06, as the H200's stored one): the step's figure,
    averaged over both, prices every op."""
    sharded_optimizer_op_overhead_s: float | None = None
    """:attr:`optimizer_op_overhead_s` for FSDP2-sharded parameters (the step on DTensors)."""
    elementwise_Bps: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(aten op name, dtype) -> the bytes per second (inputs plus outputs, counted as the op
    trace counts them) that op reached on this device when measured alone
    (:func:`sharded_exp.measure.machine.measure_elementwise`). On a CPU an op such as GELU
    (an erf per element), tanh, exp, or a softmax's or a norm's per-row reductions is paced by
    its arithmetic, not by its bytes at :attr:`memory_bandwidth`: it then takes the longer of
    the two. Only the ``this`` profile measures it; an op without a figure is priced by its
    bytes alone."""
    asynchronous: bool = False
    """Ops are launched ahead of the device (CUDA): an op's kernel starts once the host has
    launched it and the kernel before it has ended
    (:func:`sharded_exp.predict.step_time.launched_ahead`), where a CPU runs each op's host
    work and kernel one after the other (their sum)."""
    host_memory: HostMemory | None = None
    """The host memory of the server a node of these GPUs comes in, which CPU offload's
    optimizer step runs at (:class:`HostMemory`). A named GPU's file states the reference
    server's DIMMs' peak (``server_memory_bandwidth_GBps``: sockets x channels x transfer rate
    x 8 bytes) and its sockets (``server_sockets``); an in-place update moves at that peak, a
    copy at :data:`WRITE_ALLOCATE` of it. A GPU's ``this`` profile measures both on its host.
    None: not known (an offload point's step time is then null, with that reason)."""
    fresh_page_s: float | None = None
    """Seconds one new page of host memory costs when it is first written (the kernel's page
    fault and zeroing, and the unmapping when freed), measured for a CPU ``this`` profile
    (:func:`sharded_exp.measure.machine.measure_fresh_page_s`): what a step pays for each block
    glibc maps anew (:func:`sharded_exp.measure.host_malloc.mapped_from`). None: not priced."""

    def host_cost_s(self, dtype: str, sharded_parameters: bool = False, optimizer: bool = False) -> float:
        """The host's seconds per op of a training step in ``dtype`` (see above);
        ``sharded_parameters``: a step of FSDP2-sharded parameters; ``optimizer``: an op of
        the optimizer's step (in fp32), at its own figure where measured."""
        if optimizer:  # its own figure; an FSDP2 step's not measured: the plain optimizer's
            mine = self.sharded_optimizer_op_overhead_s if sharded_parameters else None
            own = mine if mine is not None else self.optimizer_op_overhead_s
            if own is not None:
                return own
            dtype = "fp32"
        plain = self.step_op_overhead_s.get(dtype, self.op_overhead_s)
        return self.sharded_step_op_overhead_s.get(dtype, plain) if sharded_parameters else plain

    @property
    def memory_bytes(self) -> float:
        return self.memory.value * 1e9

    @property
    def memory_bandwidth_Bps(self) -> float:
        """What a memory-bound op moves per second: the datasheet's bandwidth times the
        measured copy's fraction where the profile has one."""
        fraction = self.memory_bandwidth_fraction.value if self.memory_bandwidth_fraction else 1.0
        return self.memory_bandwidth.value * 1e9 * fraction

    def peak_flops_per_s(self, dtype: str) -> float:
        """The datasheet's dense peak for ``dtype``: the denominator of MFU."""
        return self._figure(self.peak_tflops, dtype, "peak TFLOP/s").value * 1e12

    def matmul_flops_per_s(self, dtype: str) -> float:
        """What a large matmul reaches: the peak times the micro-benchmark's fraction where
        one is published, else the peak itself (an upper bound, said by :meth:`is_measured`)."""
        fraction = self.achievable_fraction.get(dtype)
        return self.peak_flops_per_s(dtype) * (fraction.value if fraction else 1.0)

    def attention_flops_per_s(self, attention_pass: str, dtype: str) -> float | None:
        """What a fused attention kernel's ``forward`` or ``backward`` reaches: the peak times
        the published fraction; None where the profile has none (it is then priced as a matmul)."""
        fraction = self.attention_fraction.get((attention_pass, dtype))
        return self.peak_flops_per_s(dtype) * fraction.value if fraction else None

    def is_measured(self, dtype: str) -> bool:
        return dtype in self.achievable_fraction

    def curve(self, op_class: str, dtype: str) -> Curve | None:
        return self.curves.get((op_class, dtype))

    def _figure(self, table: Mapping[str, Figure], dtype: str, what: str) -> Figure:
        if dtype not in table:
            raise ProfileError(
                f"device profile {self.name!r} has no {what} for dtype {dtype!r} (no published figure "
                f"was found, or the device lacks it); it has: {', '.join(sorted(table)) or 'none'}"
            )
        return table[dtype]


@dataclass(frozen=True)
class LinkProfile:
    """One link class as a collective sees it from one rank: bandwidth in one direction and
    NCCL's per-step latency for the ring and tree algorithms."""

    name: str
    title: str
    link_class: str
    bandwidth: Figure
    """GB/s in one direction per GPU (what nccl-tests' bus bandwidth is compared with)."""
    ring_step_latency: Figure
    """us per ring step."""
    tree_step_latency: Figure
    """us per tree hop."""
    bus_bandwidth_fraction: Figure | None = None
    """The fraction of :attr:`bandwidth` (the line rate) NCCL's collectives reach as nccl-tests'
    bus bandwidth, where a published measurement or NCCL's maintainers state one (None: the line
    rate whole, an upper bound). On NVLink NCCL's protocol takes part of each transfer."""
    reduce_scatter_as_all_reduce: bool = False
    """The backend runs a reduce-scatter as an all-reduce of its whole input: gloo does (torch's
    ``ProcessGroupGloo``: the profiler shows ``c10d::_reduce_scatter_base_`` running
    ``gloo:all_reduce``), so a CPU's local link prices it as one
    (:func:`sharded_exp.speed.collectives.group_time`)."""
    pair_call_s: Mapping[str, float] = field(default_factory=dict)
    """Per collective kind, the seconds one small call (1 KiB) takes between two ranks on this
    link: the latency a collective of that kind pays, where it was measured (the ``this``
    profile's gloo link, :func:`sharded_exp.measure.machine.calls_s`); gloo's kinds are
    different algorithms (between two ranks a broadcast is one message one way, an all-reduce
    two exchanges both ways: 0.08 against 0.3-0.9 ms on this VM), which one per-step latency
    from an all-reduce cannot say. Empty for the sourced links: NCCL's step latencies price them."""
    solo_call_s: Mapping[str, float] = field(default_factory=dict)
    """Per collective kind, the seconds one call takes in a group of one rank, where nothing
    moves and only the call is left (torch's Python, the backend's work object and its wait):
    what a world-size-1 collective costs. Measured for the ``this`` profile's gloo link
    (:func:`sharded_exp.measure.machine.solo_call_s`); empty for the sourced links, where no
    published figure states it: a GPU's world-size-1 collective is priced at 0 there."""

    @property
    def bandwidth_Bps(self) -> float:
        """What a collective's bandwidth term moves per second one way: the line rate times
        the stated bus-bandwidth fraction where the profile has one."""
        fraction = self.bus_bandwidth_fraction.value if self.bus_bandwidth_fraction else 1.0
        return self.bandwidth.value * 1e9 * fraction

    @property
    def ring_step_latency_s(self) -> float:
        return self.ring_step_latency.value * 1e-6

    @property
    def tree_step_latency_s(self) -> float:
        return self.tree_step_latency.value * 1e-6


# ------------------------------------------------------------------ reading the files
_DEVICE_FIELDS = {
    "kind",
    "name",
    "title",
    "sources",
    "memory_GB",
    "memory_bandwidth_GBps",
    "memory_bandwidth_fraction",
    "peak_TFLOPs",
    "achievable_fraction",
    "attention_fraction",
    "curves",
    "links",
    "server_memory_bandwidth_GBps",
    "server_sockets",
    "server_memory_GiB",
}
LINK_ROLES = ("intra_node", "host")
"""What a device's ``links`` name: the link between its GPUs in a node, and to the host."""
_LINK_FIELDS = {
    "kind",
    "name",
    "title",
    "class",
    "sources",
    "total_bidirectional_GBps",
    "per_direction_GBps",
    "ring_step_latency_us",
    "tree_step_latency_us",
    "bus_bandwidth_fraction",
}


@functools.cache
def _files() -> dict[str, dict]:
    """Every shipped profile file, parsed once per process (a plan prices every point on
    them: parsing them again per point cost half a second each, 8% of a 7B plan)."""
    folder = resources.files("sharded_exp.speed") / "profile_data"
    found = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name.removesuffix(".yaml")] = yaml.safe_load(entry.read_text())
    return found


def _names(kind: str) -> list[str]:
    return sorted(name for name, data in _files().items() if data.get("kind") == kind)


def device_names() -> list[str]:
    return _names("device")


def link_names() -> list[str]:
    return _names("link")


def _load(name: str, kind: str) -> dict:
    data = _files().get(name)
    if data is None or data.get("kind") != kind:
        raise ProfileError(f"no {kind} profile named {name!r}; there are: {', '.join(_names(kind))}")
    return data


FORM_FACTORS = ("NVL", "PCIE")
"""Words of a CUDA device name that say it is not the SXM part every profile here describes:
a PCIe card (``NVIDIA A100-PCIE-40GB``, ``NVIDIA A100 80GB PCIe``, ``Tesla V100-PCIE-32GB``,
``NVIDIA H100 PCIe``) or an NVL part, whose GPUs are linked by PCIe or NVLink bridges, not
the SXM board's NVLink, and whose clocks and power differ."""

DEVICE_NAMES = (
    (("H200",), FORM_FACTORS, "h200"),
    (("H100",), FORM_FACTORS, "h100_sxm"),
    (("A100", "80GB"), FORM_FACTORS, "a100_80gb"),
    (("A100",), FORM_FACTORS, "a100_40gb"),
    (("V100",), FORM_FACTORS, "v100_32gb"),
)
"""(words a CUDA device name holds, words it must not hold, the profile), matched without
case: the more specific first. 'NVIDIA H200', 'NVIDIA A100-SXM4-80GB' and 'Tesla
V100-SXM2-32GB' are SXM parts; a PCIe or NVL part has no profile (:data:`FORM_FACTORS`)."""


def profile_for_device_name(device_name: str) -> str | None:
    """The sourced profile of a CUDA device by the name torch reports, or None (a part no
    profile describes: its links would be priced as another part's)."""
    words = set(device_name.upper().replace("-", " ").replace("(", " ").replace(")", " ").split())
    for wanted, excluded, profile in DEVICE_NAMES:
        if set(wanted) <= words and not words & set(excluded):
            return profile
    return None


def load_device(name: str) -> DeviceProfile:
    return parse_device(_load(name, "device"))


def load_link(name: str) -> LinkProfile:
    return parse_link(_load(name, "link"))


def network_link(gbps: float, name: str = "network") -> LinkProfile:
    """The inter-node link at ``gbps`` Gb/s per GPU, one direction (InfiniBand or RoCE).

    The bandwidth is the caller's stated figure (``plan.inter_node_gbps``), converted
    (/ 8); the per-step latencies come from ``network.yaml`` (NCCL's tuning table)."""
    if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
        raise ProfileError(f"the inter-node bandwidth must be a positive number of Gb/s, not {gbps!r}")
    data = _load("network", "network")
    sources = _sources(data, name)
    stated = Source("stated", f"stated by the caller: {gbps:g} Gb/s per GPU", "(parameter)")
    return LinkProfile(
        name=f"{name}_{gbps:g}gbps",
        title=f"{data['title']} at {gbps:g} Gb/s",
        link_class="network",
        bandwidth=Figure(gbps / 8, stated, "Gb/s / 8"),
        ring_step_latency=_figure(data, "ring_step_latency_us", sources, name),
        tree_step_latency=_figure(data, "tree_step_latency_us", sources, name),
    )


def parse_device(data: Mapping[str, Any]) -> DeviceProfile:
    """A device profile from a file's mapping (checked: see the module docstring)."""
    name = str(data.get("name", "?"))
    _no_unknown(data, _DEVICE_FIELDS, name)
    sources = _sources(data, name)
    peaks = _table(data.get("peak_TFLOPs"), "peak_TFLOPs", sources, name)
    if not peaks:
        raise ProfileError(f"device profile {name!r} gives no peak_TFLOPs")
    fractions = _table(data.get("achievable_fraction") or {}, "achievable_fraction", sources, name)
    for dtype, figure in fractions.items():
        if not 0 < figure.value <= 1:
            raise ProfileError(
                f"device profile {name!r}: achievable_fraction.{dtype} must be in (0, 1], not {figure.value}"
            )
        if dtype not in peaks:
            raise ProfileError(f"device profile {name!r}: achievable_fraction.{dtype} has no peak_TFLOPs.{dtype}")
    attention = {}
    for attention_pass, raw in (data.get("attention_fraction") or {}).items():
        if attention_pass not in ATTENTION_PASSES:
            raise ProfileError(
                f"device profile {name!r}: attention_fraction pass {attention_pass!r} is not one of {ATTENTION_PASSES}"
            )
        for dtype, figure in _table(raw, f"attention_fraction.{attention_pass}", sources, name).items():
            if not 0 < figure.value <= 1 or dtype not in peaks:
                raise ProfileError(
                    f"device profile {name!r}: attention_fraction.{attention_pass}.{dtype} must be in (0, 1] "
                    f"with a peak_TFLOPs.{dtype}, not {figure.value}"
                )
            attention[(attention_pass, dtype)] = figure
    copy = _figure(data, "memory_bandwidth_fraction", sources, name) if "memory_bandwidth_fraction" in data else None
    if copy is not None and not 0 < copy.value <= 1:
        raise ProfileError(f"device profile {name!r}: memory_bandwidth_fraction must be in (0, 1], not {copy.value}")
    host = _host_memory(data, sources, name)
    curves = {}
    for op_class, per_dtype in (data.get("curves") or {}).items():
        if op_class not in OP_CLASSES:
            raise ProfileError(f"device profile {name!r}: curve op class {op_class!r} is not one of {OP_CLASSES}")
        for dtype, raw in per_dtype.items():
            curves[(op_class, _dtype(dtype, name))] = _curve(raw, f"curves.{op_class}.{dtype}", sources, name)
    return DeviceProfile(
        name=name,
        title=str(data.get("title", name)),
        memory=_figure(data, "memory_GB", sources, name),
        memory_bandwidth=_figure(data, "memory_bandwidth_GBps", sources, name),
        memory_bandwidth_fraction=copy,
        peak_tflops=peaks,
        achievable_fraction=fractions,
        attention_fraction=attention,
        curves=curves,
        links=_links(data.get("links"), sources, name),
        host_memory=host,
    )


def _host_memory(data: Mapping[str, Any], sources: Mapping[str, Source], name: str) -> HostMemory | None:
    """A device file's server memory (see :attr:`DeviceProfile.host_memory`), or None."""
    given = [key for key in ("server_memory_bandwidth_GBps", "server_sockets") if key in data]
    if not given:
        if "server_memory_GiB" in data:
            raise ProfileError(f"device profile {name!r} gives server_memory_GiB without the server it belongs to "
                               "(server_memory_bandwidth_GBps and server_sockets)")  # fmt: skip
        return None
    if len(given) == 1:
        raise ProfileError(f"device profile {name!r} gives {given[0]} without the other of "
                           "server_memory_bandwidth_GBps and server_sockets")  # fmt: skip
    peak = _figure(data, "server_memory_bandwidth_GBps", sources, name)
    sockets = _figure(data, "server_sockets", sources, name)
    if not peak.value > 0:
        raise ProfileError(f"device profile {name!r}: server_memory_bandwidth_GBps must be positive, not {peak.value}")
    if sockets.value < 1 or sockets.value != int(sockets.value):
        raise ProfileError(f"device profile {name!r}: server_sockets must be a whole number >= 1, not {sockets.value}")
    copy = Figure(
        peak.value * WRITE_ALLOCATE, peak.source, "the peak x 2/3: a copy's destination is read before written"
    )
    capacity = _figure(data, "server_memory_GiB", sources, name) if "server_memory_GiB" in data else None
    if capacity is not None and not capacity.value > 0:
        raise ProfileError(f"device profile {name!r}: server_memory_GiB must be positive, not {capacity.value}")
    return HostMemory(copy=copy, in_place=peak, sockets=int(sockets.value), capacity_gib=capacity)


def _links(raw: Any, sources: Mapping[str, Source], name: str) -> dict[str, str]:
    """A device's ``links``: ``{intra_node, host}`` link profile names and their source."""
    if raw is None:
        return {}
    _sourced(raw, "links", sources, name)
    links = {k: str(v) for k, v in raw.items() if k in LINK_ROLES}
    unknown = sorted(set(raw) - set(LINK_ROLES) - {"source", "note"})
    if unknown:
        raise ProfileError(f"device profile {name!r}: links has unknown role(s) {unknown}; roles: {LINK_ROLES}")
    missing = sorted(v for v in links.values() if v not in link_names())
    if missing:
        raise ProfileError(f"device profile {name!r}: links names {missing}, not link profiles ({link_names()})")
    return links


def parse_link(data: Mapping[str, Any]) -> LinkProfile:
    """A link profile from a file's mapping. Exactly one of ``per_direction_GBps`` and
    ``total_bidirectional_GBps`` (NVLink datasheets quote the latter; a rank's collective
    sends in one direction at half of it)."""
    name = str(data.get("name", "?"))
    _no_unknown(data, _LINK_FIELDS, name)
    sources = _sources(data, name)
    if data.get("class") not in LINK_CLASSES:
        raise ProfileError(f"link profile {name!r}: class must be one of {LINK_CLASSES}, not {data.get('class')!r}")
    given = [k for k in ("per_direction_GBps", "total_bidirectional_GBps") if k in data]
    if len(given) != 1:
        raise ProfileError(f"link profile {name!r} needs exactly one of per_direction_GBps, total_bidirectional_GBps")
    bandwidth = _figure(data, given[0], sources, name)
    if given[0] == "total_bidirectional_GBps":
        bandwidth = Figure(bandwidth.value / 2, bandwidth.source, f"half of the {bandwidth.value:g} GB/s total")
    bus = _figure(data, "bus_bandwidth_fraction", sources, name) if "bus_bandwidth_fraction" in data else None
    if bus is not None and not 0 < bus.value <= 1:
        raise ProfileError(f"link profile {name!r}: bus_bandwidth_fraction must be in (0, 1], not {bus.value}")
    return LinkProfile(
        name=name,
        title=str(data.get("title", name)),
        link_class=data["class"],
        bandwidth=bandwidth,
        ring_step_latency=_figure(data, "ring_step_latency_us", sources, name),
        tree_step_latency=_figure(data, "tree_step_latency_us", sources, name),
        bus_bandwidth_fraction=bus,
    )


def _no_unknown(data: Mapping, allowed: set[str], name: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProfileError(f"profile {name!r}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _sources(data: Mapping, name: str) -> dict[str, Source]:
    sources = {}
    for key, raw in (data.get("sources") or {}).items():
        if not isinstance(raw, Mapping) or not raw.get("title") or not raw.get("url"):
            raise ProfileError(f"profile {name!r}: source {key!r} needs a title and a url")
        sources[key] = Source(key, str(raw["title"]), str(raw["url"]))
    return sources


def _sourced(raw: Any, where: str, sources: Mapping[str, Source], name: str) -> tuple[Source, str]:
    if not isinstance(raw, Mapping) or "source" not in raw:
        raise ProfileError(f"profile {name!r}: {where} has no source (every figure names one: {{value, source}})")
    if raw["source"] not in sources:
        raise ProfileError(
            f"profile {name!r}: {where} names source {raw['source']!r}, which is not among its sources "
            f"({', '.join(sources) or 'none'})"
        )
    return sources[raw["source"]], str(raw.get("note", ""))


def _figure(data: Mapping, key: str, sources: Mapping[str, Source], name: str) -> Figure:
    if key not in data:
        raise ProfileError(f"profile {name!r} has no {key}")
    raw = data[key]
    source, note = _sourced(raw, key, sources, name)
    value = raw.get("value")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"profile {name!r}: {key} must have a non-negative number as value, not {value!r}")
    return Figure(float(value), source, note)


def _dtype(dtype: str, name: str) -> str:
    if dtype not in DTYPES:
        raise ProfileError(f"profile {name!r}: dtype {dtype!r} is not one of {DTYPES}")
    return dtype


def _table(raw: Any, key: str, sources: Mapping[str, Source], name: str) -> dict[str, Figure]:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"profile {name!r}: {key} must map dtype to {{value, source}}")
    return {_dtype(d, name): _figure(raw, d, sources, f"{name}.{key}") for d in raw} if raw else {}


def _curve(raw: Any, where: str, sources: Mapping[str, Source], name: str) -> Curve:
    source, note = _sourced(raw, where, sources, name)
    points = raw.get("points") or []
    try:
        pts = tuple(sorted((float(f), float(t)) for f, t in points))
    except (TypeError, ValueError) as e:
        raise ProfileError(f"profile {name!r}: {where}.points must be [flops, TFLOP/s] pairs ({e})") from None
    if len(pts) < 1 or any(f <= 0 or t <= 0 for f, t in pts):
        raise ProfileError(f"profile {name!r}: {where}.points needs at least one pair of positive numbers")
    return Curve(pts, source, note)
