"""The peak of a user's training step, predicted by running it on fake tensors.

The same idea as a sharded_exp run's own prediction (:mod:`sharded_exp.predict.fake_step`),
for a model sharded_exp did not build: the user's module, its parameters and buffers swapped
for fake tensors of the same shapes, dtypes and devices (no storage; the real ones are not
touched), a fresh optimizer of the user's class and settings over them, and one batch of the
shapes the user's batches have. Two steps run under torch's ``MemTracker`` (the optimizer's
state appears at the first, the second is the steady one); its peak is the prediction.

A model sharded by FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``) is faked
on an unsharded copy sharded again the same way on a fake process group (:mod:`.fsdp2`).
What it cannot fake it says, with a null figure: a model under FSDP1 (its flat shards) or
fairscale's ShardedDataParallel, an FSDP2 layout :func:`.fsdp2.refusal` names, a step that
reads a tensor's value (data-dependent control flow), an optimizer whose constructor refuses
its own defaults. What DDP adds (its reduce bucket and a gradient copy) is added by DDP's rule, filed
as a run files it (:func:`ddp_extra_parts`). ``optimizer`` may be a wrapper holding the torch optimizer as
``.optimizer`` (Accelerate's, Lightning's).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from typing import Any, Callable
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils.stateless import _reparametrize_module  # private torch API: re-check on upgrades

from sharded_exp.measure.tracker import MIB, peak_tracker
from sharded_exp.strategies.ddp import DDPMemory
from sharded_exp.vocabulary.memory import BUCKET, TEMP, TOTAL, in_our_names


class Spec:
    """A tensor's shape, dtype and device, without its data (what a fake batch is made from)."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device

    def fake(self) -> torch.Tensor:  # inside FakeTensorMode: no storage
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def describe(batch: Any) -> Any:
    """``batch`` with every tensor replaced by its :class:`Spec` (dicts, lists, tuples kept)."""
    if isinstance(batch, torch.Tensor):
        return Spec(batch)
    if isinstance(batch, dict):
        return {k: describe(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(describe(v) for v in batch)
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):  # a BatchEncoding and its kind
        return {k: describe(batch[k]) for k in batch.keys()}
    return batch


def materialize(spec: Any) -> Any:
    if isinstance(spec, Spec):
        return spec.fake()
    if isinstance(spec, dict):
        return {k: materialize(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(materialize(v) for v in spec)
    return spec


def model_name(model: nn.Module) -> str:
    """The user's class name under the wrappers (FSDP2 makes ``FSDP<Name>`` classes)."""
    for cls in type(unwrap(model)[0]).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def loss_of(output: Any) -> torch.Tensor:
    """A model output's loss: a tensor itself, ``output.loss``, ``output["loss"]`` or its first item."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (list, tuple)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the loss in a {type(output).__name__}: give loss_fn=")


def call_model(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default step: the model called with the batch (keyword arguments for a mapping,
    positional ones for a list or tuple), its output's loss."""
    if isinstance(batch, dict):
        return loss_of(model(**batch))
    if isinstance(batch, (list, tuple)):
        return loss_of(model(*batch))
    return loss_of(model(batch))


def unwrap(model: nn.Module) -> tuple[nn.Module, str | None]:
    """(the module to fake, why it cannot be faked or None): DDP is unwrapped; FSDP1 and
    fairscale's ShardedDataParallel refused; FSDP2 faked on a copy (:mod:`.fsdp2`) where it can be."""
    kinds = {type(m).__name__ for m in model.modules()}  # the wrappers too
    if isinstance(model, DistributedDataParallel) or type(model).__name__ in (
        "FullyShardedDataParallel",
        "ShardedDataParallel",
    ):
        model = model.module
    if "ShardedDataParallel" in kinds:
        return model, (
            "the model is under fairscale's ShardedDataParallel: its reduce buckets and gradient release are not "
            "faked here; python -m sharded_exp.plan strategy=sharded_ddp predicts it for a model it can build"
        )
    if "FullyShardedDataParallel" in kinds:
        return model, (
            "the model is sharded by FSDP1 (FullyShardedDataParallel): a fake copy of its flat shards is not made "
            "here (FSDP2's fully_shard is); python -m sharded_exp.plan predicts FSDP for a model it can build "
            "(model=custom)"
        )
    sharded = _fsdp2(model)
    if sharded is not None:
        return model, sharded.refusal(model)
    return model, None


def _fsdp2(model: nn.Module):
    """:mod:`.fsdp2` where ``model`` is sharded by FSDP2, else None. FSDP is imported only
    where the user imported it (no model can be sharded by it otherwise), not by the probe."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    # lazy: FSDP, DTensor and the project's fake step, only for a model the user sharded with FSDP2
    from sharded_exp.probe import fsdp2

    return fsdp2 if fsdp2.is_fsdp2(model) else None


def ddp_of(model: nn.Module) -> tuple[bool, bool]:
    """(is the model under DDP, are its gradients views into the buckets)."""
    if not isinstance(model, DistributedDataParallel):
        return False, False
    return True, bool(getattr(model, "gradient_as_bucket_view", False))


def ddp_buckets_mib(model: nn.Module, ddp: tuple[bool, bool] | None = None) -> float:
    """What DDP's reduce buckets hold (MiB) beside the gradients, read from DDP's reducer; 0
    where the model is not under DDP or its gradients are views into the buckets (the
    tracker then sees the buckets as the gradients). The reducer's own list is private torch
    API (``_get_zeros_like_grad_buckets``, which makes zeroed copies for a moment): where it is
    missing, or ``model`` is the module DDP wraps (``ddp`` says so: the Trainer's callbacks get
    that one), DDP's rule (every trainable gradient has one place in a bucket) stands in."""
    under_ddp, as_view = ddp or ddp_of(model)
    if not under_ddp or as_view:
        return 0.0
    if not isinstance(model, DistributedDataParallel):
        return trainable_mib(model)
    try:
        buckets = model.reducer._get_zeros_like_grad_buckets()
        return sum(b.buffer().numel() * b.buffer().element_size() for b in buckets) / MIB
    except Exception:  # noqa: BLE001 -- a torch without it: DDP's rule
        return trainable_mib(model)


def trainable_mib(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / MIB


def ddp_extra_parts(grads_mib: float, ddp: tuple[bool, bool], buckets_seen: bool) -> dict[str, float]:
    """What DDP holds at the peak beyond the unwrapped model's step, by its rule, filed as a
    run's tracker files it (MiB by category). Without ``gradient_as_bucket_view`` (DDP's
    default) a gradient lives three times at the end of the backward: autograd's result, its
    copy in the reduce bucket, and ``param.grad`` made from the reduced bucket; the unwrapped
    step holds one, so DDP adds two gradient-sized copies: the bucket (:data:`BUCKET`; left
    out where the measurement cannot see it: a CPU probe started after DDP allocated its
    buckets) and the copy made in the backward (:data:`TEMP`, as torch's tracker files what the
    backward allocates). With ``gradient_as_bucket_view`` and gradients zeroed in place,
    ``param.grad`` is the bucket: nothing is added. How much of the bucket is beside the
    gradients is DDP's own bucket rule (:meth:`DDPMemory.buckets`, which the prediction of a
    sharded_exp run reads too)."""
    under_ddp, as_view = ddp
    if not under_ddp:
        return {}
    held, aliased = DDPMemory.buckets(grads_mib, as_view)
    beside = held - aliased  # the bucket, where the gradients are no views into it
    if not beside:
        return {}
    return {TEMP: beside, **({BUCKET: beside} if buckets_seen else {})}


def predict_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    buckets_seen: bool = True,
    ddp: tuple[bool, bool] | None = None,
    grad_accum: int = 1,
    zero_grad_after_forward: bool = False,
) -> dict[str, Any]:
    """The predicted peak of one training step (MiB), its breakdown and how it was made, or a
    null figure and the reason: ``{"peak_mib", "breakdown_mib", "method", "error", "seconds"}``.

    ``batch``: a batch or its :func:`describe`; ``step_fn(model, batch) -> loss`` (default
    :func:`call_model`); ``autocast``: the context the user's forward runs in; ``ddp``: (under
    DDP, gradients as bucket views), read from ``model`` when not given (:func:`ddp_extra_parts`).
    ``optimizer`` may be a wrapper holding the torch optimizer as ``.optimizer`` (Accelerate's,
    Lightning's). ``grad_accum``: micro-batches per optimizer step; from two on, a micro-batch's
    forward runs beside the gradients the one before left, so two are faked (more hold the same).
    ``zero_grad_after_forward``: the step's order is Lightning's (forward, ``zero_grad``,
    backward, optimizer step), not a plain loop's (forward, backward, optimizer step,
    ``zero_grad``): the forward then runs beside the previous step's gradients, which a
    small model with large activations peaks on."""
    started = time.perf_counter()
    out: dict[str, Any] = {
        "peak_mib": None,
        "breakdown_mib": None,
        "method": "fake step of the user's step",
        "error": None,
        "seconds": None,
    }
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    module, refused = unwrap(model)
    if refused:
        return {**out, "error": refused}
    extra = ddp_extra_parts(trainable_mib(module), ddp or ddp_of(model), buckets_seen)
    step_fn = step_fn or call_model
    spec = describe(batch)
    try:
        sharded = _fsdp2(module)
        if sharded is not None:
            tracker = sharded.fake_steps(
                module,
                optimizer,
                lambda copy, groups: _tracked_steps(
                    copy, _like(optimizer, groups), spec, step_fn, autocast, grad_accum, zero_grad_after_forward
                ),
            )
        else:
            tracker = _fake_steps(module, optimizer, spec, step_fn, autocast, grad_accum, zero_grad_after_forward)
        if tracker.failure is not None:
            return {**out, "error": f"the memory tracker failed on the fake step: {tracker.failure}"}
        snap = tracker.get_tracker_snapshot("peak")
        parts = next(iter(snap.values()), {}) if snap else {}
        parts = {str(getattr(k, "value", k)): v / MIB for k, v in parts.items()}
        total = parts.pop(TOTAL, sum(parts.values()))
        for name, mib in extra.items():
            parts[name] = parts.get(name, 0.0) + mib
        parts = in_our_names(parts)  # as a run's prediction names them (its report splits it alike)
        method = out["method"] + (" on a copy sharded again by FSDP2" if sharded is not None else "")
        method += " + DDP's gradient copies by its rule" if extra else ""
        return {
            **out,
            "peak_mib": total + sum(extra.values()),
            "breakdown_mib": parts,
            "method": method,
            "seconds": time.perf_counter() - started,
        }
    except Exception as exc:  # noqa: BLE001 -- a prediction that cannot be made is a null figure
        return {
            **out,
            "error": f"the step could not run on fake tensors: {type(exc).__name__}: {exc}"[:400],
            "seconds": time.perf_counter() - started,
        }


def _fake_steps(module: nn.Module, optimizer, spec, step_fn, autocast, grad_accum: int, zero_grad_after_forward=False):
    """Two of the user's steps on fake copies of ``module``'s parameters and buffers and of
    ``optimizer`` (a fresh one of its class over the same groups), under a peak tracker; the
    tracker is returned. The real tensors are only read for their shapes. The gradients are
    dropped where the user's loop drops them (see ``zero_grad_after_forward`` in
    :func:`predict_peak`): the second step is the steady one only if it starts as the user's do."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    named = list(module.named_parameters(remove_duplicate=False))  # a tied weight under each name
    buffers = list(module.named_buffers(remove_duplicate=False))
    by_id: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, t in named + buffers:
            if id(t) not in by_id:
                by_id[id(t)] = mode.from_tensor(t)
    with mode:
        for _, p in named:
            if not isinstance(by_id[id(p)], nn.Parameter):
                by_id[id(p)] = nn.Parameter(by_id[id(p)], requires_grad=p.requires_grad)
        fakes = {n: by_id[id(t)] for n, t in named + buffers}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [by_id[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        opt = _like(optimizer, groups)
        with _reparametrize_module(module, fakes):
            return _tracked_steps(module, opt, spec, step_fn, autocast, grad_accum, zero_grad_after_forward)


def _tracked_steps(module: nn.Module, opt, spec, step_fn, autocast, grad_accum: int, zero_grad_after_forward: bool):
    """Two of the user's steps of ``module`` (its tensors fake) with ``opt`` under a peak
    tracker, in the user's order (see :func:`predict_peak`); the tracker is returned."""
    tracker = peak_tracker()
    with _quiet(module):
        tracker.track_external(module, opt)
        with tracker:
            for _ in range(2):
                for micro in range(min(max(1, int(grad_accum)), 2)):
                    fake_batch = materialize(spec)
                    with autocast or contextlib.nullcontext():
                        loss = step_fn(module, fake_batch)
                    if zero_grad_after_forward and micro == 0:  # Lightning: the first micro-batch's
                        opt.zero_grad(set_to_none=True)
                    loss.backward()
                    del loss, fake_batch
                opt.step()
                if not zero_grad_after_forward:
                    opt.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
    return tracker


def _like(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class over ``groups`` (each group carries every
    setting); the defaults its constructor takes are passed too, for keys a group lacks."""
    takes = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes}
    return type(optimizer)(groups, **defaults)


@contextlib.contextmanager
def _quiet(module: nn.Module):
    """A LightningModule's ``log``/``log_dict`` do nothing while its step runs fake (a fake value
    must never reach the user's logs)."""
    patches = [
        mock.patch.object(module, name, lambda *a, **k: None)
        for name in ("log", "log_dict")
        if callable(getattr(module, name, None))
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield
