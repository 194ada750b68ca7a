"""A fake step for a GPU, run on fake CPU tensors: CUDA's kernel choices without CUDA.

A fake step faked on a CUDA device would initialise CUDA in the parent (a context of
0.3-0.6 GiB on rank 0's GPU, outside every counter), and on a torch built without CUDA
it cannot run at all (DDP's reducer and SDPA's kernel choice abort the process). So a
step planned for a GPU is faked on the CPU device, and where CUDA would run something
that holds different memory, :func:`cuda_kernels` makes the step hold what CUDA would:

- **attention**: ``F.scaled_dot_product_attention`` on CUDA runs a fused kernel (flash or
  memory-efficient attention, dropout included) that keeps the output and a float32
  log-sum-exp per query for the backward, never the B x H x T x T scores; the CPU runs
  the math path whenever there is dropout (hf_gpt2_small bf16 batch 8 planned 26,845 MiB
  of scores). Here attention holds what the fused kernels hold, its backward the
  gradients plus a float32 query-gradient accumulator and a float32 row term (flash
  attention 2's), and its FLOPs are counted by torch's own formulas;
- **the optimizer**: ``foreach`` (group-sized temporaries), as torch picks for CUDA
  tensors (:func:`sharded_exp.optim.optimizer_spec` asks :func:`target_device`).

Warning: the emulation is a ``TorchFunctionMode``, and ``Tensor.backward`` is itself a
torch function: the mode is off the stack while the backward runs, so a checkpointed
unit's recomputation (which runs inside the backward) would run the CPU's attention and
save other tensors than its forward did (torch.utils.checkpoint then raises "Recomputed
values ... different metadata"; pytorch/pytorch#147995). Activation checkpointing runs the
recomputation under :func:`forward_kernels` (:mod:`sharded_exp.train.levers`), as the
checkpoint maintainers advise (re-enable the mode through ``context_fn``).

What no fake tensor holds is added by rule, each part named in the breakdown:
:func:`cublas_workspace_mib`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter

MIB = 2**20

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("fake_step_target", default=None)
_MODE: contextvars.ContextVar[_AsOnCuda | None] = contextvars.ContextVar("fake_step_kernels", default=None)


_KERNEL_OUTPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("fused_kernel_outputs", default=False)


def makes_kernel_outputs() -> bool:
    """Whether the op being dispatched now allocates the outputs of an emulated fused
    kernel: selective checkpointing keeps them, as it keeps the outputs of CUDA's attention
    ops (:data:`sharded_exp.train.levers.SAVED_BY_SELECTIVE`), which here are plain
    ``new_empty`` calls inside :class:`_FusedAttention`."""
    return _KERNEL_OUTPUTS.get()


_KEPT: contextvars.ContextVar[bool] = contextvars.ContextVar("fused_kernel_outputs_kept", default=False)


@contextlib.contextmanager
def outputs_kept():
    """Inside: a recomputation whose checkpointing kept the fused kernels' outputs from the
    forward (selective checkpointing: its policies keep CUDA's attention ops, and torch hands
    the recomputation what was kept). Its attention calls run no kernel on CUDA, so the op
    trace times no second forward for them; their memory is the kept outputs'."""
    token = _KEPT.set(True)
    try:
        yield
    finally:
        _KEPT.reset(token)


def target_device(actual: torch.device) -> str:
    """The device type whose kernels a step runs as: the target of a fake step for a GPU
    run on CPU tensors, else the tensors' own."""
    return _TARGET.get() or actual.type


class _FusedAttention(torch.autograd.Function):
    """Memory of CUDA's fused attention (flash / memory-efficient), shapes only: this
    runs under FakeTensorMode, where no value is ever computed."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        token = _KERNEL_OUTPUTS.set(True)
        try:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        finally:
            _KERNEL_OUTPUTS.reset(token)
        # Both are outputs (the log-sum-exp not differentiable). A checkpointed unit's
        # recomputation runs this function again (see the module's warning), so it saves
        # the same tensors in the same order, which checkpointing checks position by position.
        ctx.mark_non_differentiable(logsumexp)
        ctx.save_for_backward(q, k, v, logsumexp, out)
        return out, logsumexp

    @staticmethod
    def backward(ctx, grad_out, grad_logsumexp):
        q, k, v, logsumexp, out = ctx.saved_tensors
        row_term = torch.empty_like(logsumexp)  # rowsum(dO * O), float32
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del row_term, dq_accum
        return dq, dk, dv, None


class _AsOnCuda(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        """FLOPs of the attention calls since the last reset (torch's sdpa formulas)."""
        self.calls: list[tuple[int, int, int, str, bool]] = []
        """Each call's (forward FLOPs, backward FLOPs, bytes of q, k and v, math dtype, causal):
        the op trace (:mod:`sharded_exp.predict.op_trace`) times them."""
        self.kept: set[int] = set()
        """The calls (indices into :attr:`calls`) made in a recomputation whose checkpointing
        kept the kernels' outputs (:func:`outputs_kept`): on CUDA no kernel runs for them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
            forward, backward = flop_counter.sdpa_flop_count(*shapes), 0
            if q.requires_grad or k.requires_grad or v.requires_grad:
                out_shape = (*q.shape[:-1], v.shape[-1])
                backward = flop_counter.sdpa_backward_flop_count(out_shape, *shapes)
            self.flops += forward + backward
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "fp32")
            causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
            nbytes = sum(t.numel() * t.element_size() for t in (q, k, v))
            self.calls.append((forward, backward, nbytes, dtype, causal))
            if _KEPT.get():
                self.kept.add(len(self.calls) - 1)
            out, _ = _FusedAttention.apply(q, k, v, mask)
            return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kernels():
    """Inside: the step runs as on CUDA (attention, optimizer). Yields the mode, whose
    ``flops`` counts the attention FLOPs that no aten op carries here."""
    mode = _AsOnCuda()
    token, mode_token = _TARGET.set("cuda"), _MODE.set(mode)
    try:
        with mode:
            yield mode
    finally:
        _MODE.reset(mode_token)
        _TARGET.reset(token)


def forward_kernels() -> _AsOnCuda | None:
    """The emulation a forward runs under (None outside :func:`cuda_kernels`): a context
    manager that puts it back on the stack, for a recomputation of that forward inside the
    backward (see the module's warning). Entering it where it is already on the stack
    costs a second pass through its handler, nothing else."""
    return _MODE.get()


HOPPER_WORKSPACE_MIB = 32.0
"""torch's cuBLAS workspace per handle and stream on compute capability 9.0 and later."""
EARLIER_WORKSPACE_MIB = (4096 * 2 + 16 * 8) / 1024
"""Before 9.0 (``:4096:2:16:8``): 8.125 MiB."""


def cublas_workspace_mib(capability: tuple[int, int] | None = None) -> tuple[float, str]:
    """The cuBLAS workspace a CUDA run holds through the caching allocator (counted in its
    allocated bytes, invisible to a fake step), and where the figure comes from. One
    handle on one stream: the training step and its backward run on the current stream.
    ``CUBLAS_WORKSPACE_CONFIG`` (``:KiB:count`` pairs) wins; else torch's default for the
    compute capability, Hopper's when it is not known (the planner, a parent that must
    not start CUDA to ask)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(kib) * int(n) for kib, n in pairs) / 1024, f"CUBLAS_WORKSPACE_CONFIG={config}"
    if capability is not None and capability[0] < 9:
        return EARLIER_WORKSPACE_MIB, f"torch's default cuBLAS workspace for compute capability {capability[0]}.x"
    known = "9.0+" if capability is not None else "9.0+ assumed (8.125 MiB before Hopper)"
    return HOPPER_WORKSPACE_MIB, f"torch's default cuBLAS workspace, compute capability {known}"
