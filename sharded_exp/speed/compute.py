"""How long one op takes on a device, and ops read from a FLOP counter's per-op records.

An op is (class, FLOPs, bytes moved, dtype). Its time is

- the profile's measured curve for that class and dtype where it has one: FLOPs / the
  achieved rate at that size, read from (FLOPs, TFLOP/s) points by straight lines in log-log
  space (clamped at both ends: no extrapolation past what was measured). An attention
  curve measured on causal calls (:attr:`Curve.causal_calls`) has its rate per FLOP as torch
  counts them (the whole square), of which a causal kernel runs half (below): a call that is
  not causal runs them all, twice the causal call's time;
- otherwise the roofline: ``max(FLOPs / matmul rate(dtype), bytes / memory bandwidth)``, where
  the matmul rate is the datasheet peak times a published micro-benchmark's fraction when the
  profile has one (:meth:`DeviceProfile.matmul_flops_per_s`).
- a 2-D matmul whose operands' layout the trace recorded (``nt``, ``nn``, ``tn``) on the
  profile's curve for that layout where it has one (:attr:`DeviceProfile.layout_curves`: the
  ``this`` profile measures a linear layer's three matmuls, operands read from memory), else
  as any matmul.
- ``attention`` (a fused kernel: flash or memory-efficient) at the profile's published
  attention fraction of the peak where it has one, for the forward or the backward
  (:meth:`DeviceProfile.attention_flops_per_s`); a causal kernel skips the blocks above the
  diagonal, so it does half the FLOPs torch's formulas count (FlashAttention-2's benchmark
  counts them so, and its published fractions are of that count). Without a fraction,
  attention is priced as a matmul, its FLOPs as counted.
- ``other`` ops (elementwise, norms, softmax, copies, reductions) are memory-bound:
  ``bytes / memory bandwidth``; except an op whose own pace the profile measured
  (:attr:`DeviceProfile.elementwise_Bps`: on a CPU, GELU's erf, tanh, exp, a softmax's or a
  norm's per-row work cost more than their bytes), which takes the longer of that and its
  bytes at its own measured rate. An in-place variant (``tanh_``) is its op's.

Warning: the roofline is an optimistic bound for small matmuls (a kernel launch, tile and
wave quantization are not in it); a measured curve is what corrects it, where one exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch.utils._pytree import tree_flatten

from sharded_exp.errors import ConfigError
from sharded_exp.speed.profiles import DTYPES, Curve, DeviceProfile

OP_KINDS = ("matmul", "attention", "other")

SKIPPED_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor", "profiler", "prim", "prims")
"""Op namespaces not timed as compute (collectives, DTensor's and the profiler's markers)."""
NO_BYTES = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias", "lift_fresh")
"""Ops that allocate or alias without reading or writing data."""


def timed_op(func) -> bool:
    """Whether the time model counts this dispatched op (an ``OpOverload``): not a collective
    or marker, not a view, not an allocation or alias. The op trace records these, and the
    ``this`` profile's host cost per op divides a step by their number."""
    namespace, _, base = func.name().partition("::")  # "aten::mm"
    return namespace not in SKIPPED_NAMESPACES and not func.is_view and base not in NO_BYTES


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in ``tree`` (an op's arguments, or its outputs): what the op trace
    counts an op as reading or writing, and what the ``this`` profile's elementwise rates are
    counted in."""
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "linear",
    "convolution", "_convolution", "convolution_backward", "cudnn_convolution", "conv2d", "conv1d",
})  # fmt: skip
"""aten op names (overload and namespace stripped) priced as matmuls: the ops torch's
``FlopCounterMode`` counts FLOPs for, convolutions included (implicit GEMMs)."""
ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_", "scaled_dot_product_")
"""aten op name prefixes priced as attention (the SDPA kernels and their backwards)."""
FUSED_ATTENTION = "attention"
"""The name a step faked as CUDA gives its fused attention calls (``attention.forward``,
``attention.backward``: :mod:`sharded_exp.predict.op_trace`); no aten op carries them."""


@dataclass(frozen=True)
class Op:
    kind: str
    """One of :data:`OP_KINDS`."""
    flops: float
    bytes_moved: float
    """Bytes read and written (inputs + outputs)."""
    dtype: str
    """Math dtype, one of :data:`sharded_exp.speed.profiles.DTYPES`."""
    name: str = ""
    causal: bool = False
    """An attention op with a causal mask (``is_causal``): its kernel does about half the
    FLOPs counted."""
    layout: str = ""
    """A 2-D matmul's operands as read (``nt``: the second transposed, as a linear layer's
    forward ``x @ W^T``; see :mod:`sharded_exp.predict.op_trace`); empty where not recorded."""

    @property
    def base(self) -> str:
        """The aten op's name without namespace and overload (``gelu`` for ``aten.gelu.default``)."""
        return base_name(self.name)

    @property
    def backward(self) -> bool:
        """An attention kernel's backward (its name says so: ``attention.backward``,
        ``aten._scaled_dot_product_flash_attention_backward``)."""
        return "backward" in self.name

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ConfigError(f"op kind must be one of {OP_KINDS}, not {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"op dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.flops < 0 or self.bytes_moved < 0:
            raise ConfigError(f"op {self.name or self.kind}: FLOPs and bytes must be >= 0")


def achieved_flops_per_s(curve: Curve, flops: float) -> float:
    """The curve's rate (FLOP/s) at an op of ``flops`` FLOPs: linear in (log FLOPs, log
    TFLOP/s) between the two nearest points, the end point's rate outside them."""
    points = curve.points
    if flops <= points[0][0]:
        return points[0][1] * 1e12
    if flops >= points[-1][0]:
        return points[-1][1] * 1e12
    x = math.log(flops)
    for (f0, t0), (f1, t1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            w = (x - math.log(f0)) / (math.log(f1) - math.log(f0)) if f1 > f0 else 0.0
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))) * 1e12
    raise AssertionError("unreachable: the points are sorted")


def op_time(op: Op, device: DeviceProfile) -> float:
    """Seconds for ``op`` on ``device`` (see the module docstring)."""
    memory_s = op.bytes_moved / device.memory_bandwidth_Bps
    if op.kind == "other":
        rate = device.elementwise_Bps.get((op.base.removesuffix("_"), op.dtype))
        return max(memory_s, op.bytes_moved / rate) if rate else memory_s
    if op.flops == 0:
        return memory_s
    curve = device.layout_curves.get((op.layout, op.dtype)) if op.kind == "matmul" else None
    curve = curve or device.curve(op.kind, op.dtype)
    if curve is not None:
        seconds = op.flops / achieved_flops_per_s(curve, op.flops)
        return 2 * seconds if op.kind == "attention" and curve.causal_calls and not op.causal else seconds
    if op.kind == "attention":
        rate = device.attention_flops_per_s("backward" if op.backward else "forward", op.dtype)
        if rate is not None:
            return max(op.flops * (0.5 if op.causal else 1.0) / rate, memory_s)
    return max(op.flops / device.matmul_flops_per_s(op.dtype), memory_s)


def compute_time(ops: Iterable[Op], device: DeviceProfile) -> float:
    """Seconds for ``ops`` run one after another (one stream)."""
    return sum(op_time(op, device) for op in ops)


def base_name(aten_name: str) -> str:
    """An aten op's name in any of its spellings (``aten.mm.default``, ``aten::addmm``,
    ``torch.ops.aten.bmm.default``, ``mm``) without namespace and overload."""
    parts = str(aten_name).replace("::", ".").split(".")
    while len(parts) > 1 and parts[0] in ("torch", "ops", "aten", "prims"):
        parts = parts[1:]
    return parts[0]


def classify(aten_name: str) -> str:
    """``matmul``, ``attention`` or ``other`` for an aten op name in any of its spellings
    (:func:`base_name`)."""
    base = base_name(aten_name)
    if base in MATMUL_OPS:
        return "matmul"
    if base.startswith(ATTENTION_PREFIXES) or base == FUSED_ATTENTION:
        return "attention"
    return "other"


def ops_from_records(records: Iterable[Mapping], dtype: str) -> list[Op]:
    """Ops from FlopCounterMode-style per-op records, in order.

    Each record is a mapping with ``op`` (the aten name), ``flops``, ``input_bytes`` and
    ``output_bytes``; an optional ``dtype`` overrides ``dtype`` (the step's math dtype, e.g.
    ``bf16`` under autocast), an optional ``causal`` marks a causal attention call. A record missing a field is refused, naming it."""
    ops = []
    for i, record in enumerate(records):
        missing = [k for k in ("op", "flops", "input_bytes", "output_bytes") if k not in record]
        if missing:
            raise ConfigError(f"op record {i} ({record.get('op', '?')}) lacks {missing}")
        kind = classify(record["op"])
        ops.append(
            Op(
                kind=kind,
                flops=float(record["flops"]),
                bytes_moved=float(record["input_bytes"]) + float(record["output_bytes"]),
                dtype=str(record.get("dtype", dtype)),
                name=str(record["op"]),
                causal=bool(record.get("causal", False)),
                layout=str(record.get("layout", "")),
            )
        )
    return ops
