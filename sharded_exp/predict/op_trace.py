"""The op trace of a fake step: every aten op one rank runs, for the time model.

:class:`OpTrace` is a ``TorchDispatchMode`` entered inside the fake step's ``FakeTensorMode``
(as torch's ``FlopCounterMode`` is). For each aten op it records plain numbers only (no
tensor is kept, so the memory the step tracks is not changed):

- ``op``: the aten name (``aten.mm.default``);
- ``flops``: from ``torch.utils.flop_counter``'s registry, the formulas ``FlopCounterMode``
  uses (0 for an op it has none for: elementwise ops, norms, copies);
- ``input_bytes`` and ``output_bytes``: the bytes of the tensors it reads and writes;
- ``dtype``: the time model's math dtype of its first floating input (``bf16``, ``fp16``,
  ``fp32``);
- ``layout`` (a 2-D matmul only: ``mm``, ``addmm``): ``n`` or ``t`` for each operand, ``t``
  where it is read transposed (a column-major view, as ``W.t()`` in a linear layer's forward
  ``x @ W^T``, ``nt``; the weight's gradient ``g^T @ x`` is ``tn``); a CPU's matmul rate
  depends on it;
- ``phase``: ``forward``, ``backward`` (inside autograd's backward, which is where
  activation checkpointing's recomputation runs: it is counted) or ``optimizer`` (after the
  step's last backward op: clipping and the optimizer step);
- ``unit``: the index of the model's unit (:func:`sharded_exp.models.units`) whose forward
  is running, or None (the root: embeddings, the head, the loss); backward ops carry None;
- ``fresh_bytes``: the sizes of the new storages it made (outputs that alias no input) of
  at least :data:`FRESH_MIN_BYTES`, with those of the untimed ops (``empty``, a collective's
  output buffer) since the op before: on CPU a block glibc maps is new pages every step
  (:func:`sharded_exp.measure.host_malloc.mapped_from`), whose first touch the time model prices.

The records feed :func:`sharded_exp.speed.compute.ops_from_records`. Collectives (c10d ops)
are left out: the strategy's schedule prices communication. Views and metadata ops move no
bytes and are left out too.

Under ``cuda_kernels`` (a step faked as CUDA runs it) fused attention is one
``torch.autograd.Function`` whose aten ops are empty allocations; its FLOPs are those the
kernels' mode counts (``kernels.calls``): each call is recorded as one ``attention`` op in
the forward and one in the backward (``causal`` set where the call asked for a causal mask). A
call that runs inside the backward is activation checkpointing's recomputation: its forward
is recorded, not a second backward (the kernel's backward runs once, for the first call),
unless selective checkpointing kept the call's outputs (its policies keep attention's):
then no kernel runs and nothing is recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from sharded_exp.measure.flops import count_cpu_attention
from sharded_exp.speed.compute import classify, tensor_bytes, timed_op

count_cpu_attention()  # the CPU's fused attention gets FLOPs in the trace


MATH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""Math dtypes by torch dtype; any other floating dtype is timed as fp32."""

FRESH_MIN_BYTES = 128 * 1024
"""The smallest new storage recorded: glibc's default mmap threshold (smaller blocks come from
the heap whatever the threshold's setting)."""


@dataclass
class Trace:
    """A step's op records (see the module docstring) and how many units the model has."""

    records: list[dict[str, Any]] = field(default_factory=list)
    units: int = 0

    def phased(self) -> list[dict[str, Any]]:
        """The records with ``phase`` set: forward ops after the step's last backward op are
        the optimizer's (clipping and step)."""
        last = max((i for i, r in enumerate(self.records) if r["backward"]), default=-1)
        out = []
        for i, r in enumerate(self.records):
            phase = "backward" if r["backward"] else ("forward" if i < last else "optimizer")
            # a recomputed unit (checkpointing) that stops early leaves its mark set: only a
            # forward op belongs to a unit
            out.append({**r, "phase": phase, "unit": r["unit"] if phase == "forward" else None})
        return out


def _fresh(func, out) -> tuple[int, ...]:
    """The sizes of the new storages ``func`` returned, of at least :data:`FRESH_MIN_BYTES`
    (none for an op whose schema says an output aliases an input: a view or an in-place op)."""
    if any(r.alias_info is not None for r in func._schema.returns):
        return ()
    leaves, _ = tree_flatten(out)
    sizes = (t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))
    return tuple(n for n in sizes if n >= FRESH_MIN_BYTES)


def _dtype(args) -> str:
    leaves, _ = tree_flatten(args)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return MATH_DTYPES.get(t.dtype, "fp32")
    return "fp32"


MATMUL_OPERANDS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.addmm: (1, 2)}
"""The 2-D matmuls whose ``layout`` is recorded: the positions of their two operands."""


def _read_as(matrix: torch.Tensor) -> str:
    """``t`` for a matrix stored column-major (a transposed view), else ``n``."""
    return "t" if matrix.stride(-1) != 1 and matrix.stride(-2) == 1 else "n"


class OpTrace(TorchDispatchMode):
    """Records each aten op into ``trace`` (see the module docstring)."""

    def __init__(self, trace: Trace, kernels=None):
        super().__init__()
        self.trace = trace
        self.unit: int | None = None
        self.kernels = kernels
        self._calls = len(getattr(kernels, "calls", ()))
        self._fresh: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._fresh += _fresh(func, out)
        self._attention()
        if not timed_op(func):
            return out
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        self._record(str(func), int(flops), tensor_bytes((args, kwargs)), tensor_bytes(out), _dtype(args))
        if classify(str(func)) == "attention":  # a fused kernel run here (the CPU's): causal as called
            self.trace.records[-1]["causal"] = is_causal(func, args, kwargs)
        operands = MATMUL_OPERANDS.get(packet)
        if operands is not None:
            self.trace.records[-1]["layout"] = "".join(_read_as(args[i]) for i in operands)
        return out

    def _record(self, op: str, flops: int, input_bytes: int, output_bytes: int, dtype: str) -> None:
        backward = torch._C._current_graph_task_id() != -1
        unit = None if backward else self.unit
        self.trace.records.append(
            {"op": op, "flops": flops, "input_bytes": input_bytes, "output_bytes": output_bytes, "dtype": dtype,
             "backward": backward, "unit": unit, "fresh_bytes": self._fresh}
        )  # fmt: skip
        self._fresh = ()

    def _attention(self) -> None:
        """Fused attention calls the kernels' mode counted since the last op (forward and
        backward FLOPs of each, recorded where they run: the backward's after the forward's,
        as one op in the backward phase)."""
        calls = getattr(self.kernels, "calls", None)
        while calls is not None and self._calls < len(calls):
            forward, backward, nbytes, dtype, causal = calls[self._calls]
            self._calls += 1
            if self._calls - 1 in self.kernels.kept:
                continue  # a recomputation served from what selective checkpointing kept: no kernel
            self._record("attention.forward", forward, nbytes, nbytes // 4, dtype)
            self.trace.records[-1]["causal"] = causal
            if torch._C._current_graph_task_id() != -1:
                continue  # a recomputation: its backward is the first call's
            self.trace.records.append(
                {"op": "attention.backward", "flops": backward, "input_bytes": nbytes, "output_bytes": nbytes,
                 "dtype": dtype, "backward": True, "unit": None, "deferred": True, "causal": causal}
            )  # fmt: skip


def is_causal(func, args, kwargs) -> bool:
    """An attention op's ``is_causal`` argument as called (the CPU's flash kernel and its
    backward take one), False where it has none."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "is_causal":
            if "is_causal" in kwargs:
                return bool(kwargs["is_causal"])
            return bool(args[i]) if i < len(args) else bool(argument.default_value)
    return False


@contextlib.contextmanager
def unit_marks(recorder: OpTrace, units: list[torch.nn.Module]):
    """Forward hooks that tell ``recorder`` which unit is running (no tensor is touched)."""
    handles = []
    for i, unit in enumerate(units):

        def enter(module, args, i=i):
            recorder.unit = i

        def leave(module, args, output):
            recorder.unit = None

        handles += [unit.register_forward_pre_hook(enter), unit.register_forward_hook(leave)]
    recorder.trace.units = len(units)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def tracing(trace: Trace | None, units: list[torch.nn.Module], kernels=None):
    """Record the ops run inside into ``trace`` (None: record nothing)."""
    if trace is None:
        yield
        return
    recorder = OpTrace(trace, kernels)
    with unit_marks(recorder, units), recorder:
        yield
    # a deferred attention backward runs in the backward: moved to just before the optimizer
    deferred = [r for r in trace.records if r.pop("deferred", False)]
    if deferred:
        moved = {id(r) for r in deferred}
        rest = [r for r in trace.records if id(r) not in moved]
        last = max((i for i, r in enumerate(rest) if r["backward"]), default=len(rest) - 1)
        trace.records[:] = rest[: last + 1] + deferred + rest[last + 1 :]
