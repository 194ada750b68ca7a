"""Levers on the model itself, applied to each of its units before the strategy wraps it,
so they compose with every strategy: activation checkpointing and torch.compile.

Both change a unit's ``forward`` in place, not the module tree: parameter names, state
dicts and checkpoints are the same with and without them (a run may resume with another
setting), and FSDP still wraps the same units.

- ``trainer.activation_checkpointing=full``: a unit keeps only its inputs; its forward
  runs again in the backward (torch's non-reentrant checkpoint, which restores the RNG
  state, so dropout recomputes the same mask: parameters are bit-identical to no AC).
- ``selective``: the outputs of the matmuls and attention are kept and the cheap ops
  (activations, norms, dropout, casts) recomputed (torch's selective checkpoint policy).
- ``selective_op``: torchtitan's per-op policy (``activation_checkpoint.mode="selective"``,
  ``selective_ac_option="op"``): as ``selective``, but of a unit's matmuls (``mm``, and
  ``addmm`` for a linear with a bias) only the odd ones (1st, 3rd, ...) are kept; every
  second one is recomputed in the backward.
  torchtitan's per-layer option (``selective_ac_option="2"``: full AC on every second
  layer) is ``full`` with ``trainer.ac_every=2``.
- ``trainer.ac_every=N``: only every N-th unit (0, N, 2N, ...).
- ``trainer.compile=true``: each unit's forward is compiled (``torch.compile``, inductor).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from sharded_exp.config import TrainerConfig
from sharded_exp.measure.cuda_kernels import forward_kernels, makes_kernel_outputs, outputs_kept
from sharded_exp.models import units

aten = torch.ops.aten
SAVED_BY_SELECTIVE = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""Ops whose outputs a selectively checkpointed unit keeps: the expensive ones."""


def _value(option) -> str:
    return str(option)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # makes_kernel_outputs: a fake step for a GPU, whose emulated fused attention stands for
    # CUDA's attention ops above
    keep = op in SAVED_BY_SELECTIVE or makes_kernel_outputs()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


MATMULS = {aten.mm.default, aten.addmm.default}
"""The matmuls torchtitan's op policy counts: its models' linears (no bias) run ``mm``; a
linear with a bias runs ``addmm``, counted alike."""


def torchtitan_op_policy():
    """torchtitan's per-op policy, made afresh for each checkpointed call: matmul and
    attention outputs kept, except every second matmul (:data:`MATMULS`, counted apart in the forward and in
    the recomputation, so that both decide alike)."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _keep_matmuls(ctx, op, *args, **kwargs)

    return policy


def _torchtitan_op_contexts():
    return create_selective_checkpoint_contexts(torchtitan_op_policy())


POLICIES = {
    "full": None,
    "selective": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls),
    "selective_op": _torchtitan_op_contexts,
}
"""Each checkpointing mode's ``context_fn`` (None: full checkpointing, torch's default)."""


_EAGER = contextvars.ContextVar("activation_checkpointing_off", default=False)


@contextlib.contextmanager
def without_checkpointing():
    """Checkpointed units run plainly inside: a fake step counts model FLOPs so (MFU counts
    the model's FLOPs, not the recomputed forward's)."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


@contextlib.contextmanager
def _both(kernels, recompute_context, kept: bool):
    with kernels, recompute_context, outputs_kept() if kept else contextlib.nullcontext():
        yield


def _recomputed_under(kernels, context_fn, kept: bool = False):
    """``context_fn``'s pair of contexts, the recomputation's also under ``kernels``;
    ``kept``: the policy keeps the fused kernels' outputs (every selective one does)."""
    forward_context, recompute_context = context_fn()
    return forward_context, _both(kernels, recompute_context, kept)


def _checkpointed(forward, mode: str):
    context_fn = POLICIES[mode]

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if _EAGER.get():
            return forward(*args, **kwargs)
        options = {} if context_fn is None else {"context_fn": context_fn}
        # A fake step for a GPU: the recomputation (inside the backward, where the kernel
        # emulation's TorchFunctionMode is off the stack) runs CUDA's kernels as the
        # forward did, so it saves the same tensors. (Never under torch.compile, which
        # takes only TorchDispatchModes as checkpoint contexts: no emulation there.)
        kernels = None if torch.compiler.is_compiling() else forward_kernels()
        if kernels is not None:
            options["context_fn"] = functools.partial(
                _recomputed_under, kernels, context_fn or noop_context_fn, context_fn is not None
            )
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


def checkpointed_units(module: nn.Module, mode, every: int = 1) -> list[nn.Module]:
    """Wrap every ``every``-th unit's forward in activation checkpointing (``mode``: none,
    full, selective or selective_op); returns the units wrapped."""
    mode = _value(mode)
    if mode == "none":
        return []
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        # A Hugging Face model keeps a key/value cache when use_cache is on; a recomputed
        # unit would append to it again (twice the keys): off, as HF's own checkpointing does.
        config.use_cache = False
    chosen = units(module)[::every]
    for unit in chosen:
        unit.forward = _checkpointed(unit.forward, mode)
    return chosen


def compile_units(module: nn.Module, mode) -> list[nn.Module]:
    """``torch.compile`` each unit's forward in place (``mode``: a CompileMode, _ for -).
    Its forward, not the module (``torch.compile(unit)`` would rename every parameter
    under ``_orig_mod.``; ``unit.compile()`` left the units eager on torch 2.13 here)."""
    mode = _value(mode).replace("_", "-")
    found = units(module)
    for unit in found:
        unit.forward = torch.compile(unit.forward, mode=None if mode == "default" else mode)
    return found


def apply_levers(module: nn.Module, trainer_cfg: TrainerConfig, compile: bool = True) -> None:
    """The configured levers on ``module``'s units: checkpointing first, then compile (a
    compiled unit traces through its checkpoint). ``compile=False``: eager (a fake step)."""
    checkpointed_units(module, trainer_cfg.activation_checkpointing, trainer_cfg.ac_every)
    if compile and trainer_cfg.compile:
        compile_units(module, trainer_cfg.compile_mode)
