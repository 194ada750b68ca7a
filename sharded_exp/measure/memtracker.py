"""The adapter over torch's private MemTracker: the one file to re-check on a torch upgrade.

torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a TorchDispatchMode that
follows every storage from allocation to free and files it as parameter, gradient, optimizer
state, activation or temporary) is private API: it may change in any torch release. Every
use of it that reaches past its public methods is in this file, in :class:`PeakTracker`;
the rest of sharded_exp (:mod:`sharded_exp.measure.tracker`, the fake step, the probe) calls
only what :class:`PeakTracker` offers. Importing this module imports torch's ``_tools``
package, which imports torch._inductor and dynamo (about 3 s): it is imported when a
tracker is first made (:func:`sharded_exp.measure.tracker.peak_tracker`), not before.

On a torch upgrade, check that these still exist and mean the same:

- module level: ``MemTracker``, ``_RefType`` (extended with our categories, :data:`OWN_CATEGORIES`), ``_MemRefType``
  (``ACT``, ``TEMP``, ``OTH``, ``GRAD``), ``_UpdateType`` (``ADD``, ``REF``), ``_TOTAL_KEY``,
  ``get_untyped_storages``; a ``_WeakRefInfo`` has ``reftype``, ``device``, ``mem_consumed``
  (and takes our ``owner``);
- methods overridden or wrapped (their signatures): ``__torch_dispatch__`` (its ``func``: an
  ``OpOverload`` with ``is_view``), ``_register_global_optimizer_hook`` (sets
  ``_optimizer_hook_handles``, a tuple its deregistration removes), ``_pre_fw_hook``, ``_post_fw_hook``,
  ``_pre_bw_hook``, ``_post_bw_hook``, ``_track``, ``_update_peak_stats``,
  ``_track_optimizer_states``, ``_delete_callback``, ``_update_snap``,
  ``_update_and_maybe_create_winfos``, ``_track_module_params_and_buffers``, ``track_external``;
- state read or written: ``_curr_mem_snap``, ``_peak_mem``, ``_peak_mem_snap``, ``_in_opt``,
  ``_WINFO``, ``_ref_class``, ``_param_to_grad_hook_handles``, ``memory_tracking``, and its
  ``_mod_tracker`` (ModTracker): ``parents``, ``is_bw``, ``_known_modules``, ``get_known_fqn``;
- public methods used: ``track_external``, ``get_tracker_snapshot``, ``reset_mod_stats``, and
  the context manager;
- the op ``prim.device.default``: a fake tensor's device asked from C++ (autograd's engine),
  which reaches the dispatch and is answered without the tracker's walk;
- FSDP2's (:func:`fsdp2_gathered`): ``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``,
  each with ``all_gather_outputs``;
- for the testing aid ``SHARDED_EXP_FAULT=tracker_error`` (:func:`fail_in_hooks`):
  ``_track_inputs_or_outputs``, which every module's forward hooks call.

``tests/unit/measure/test_memtracker.py`` and ``tests/unit/measure/test_tracker.py`` exercise
each of these on tiny tensors; run them first after an upgrade.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools import mem_tracker
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sharded_exp.vocabulary.memory import BUCKET, OWN_CATEGORIES

MIB = 2**20
TOP_MODULES = 5
"""Modules named in an out-of-memory breakdown (the rest are summed)."""

_GUARDED = (
    "_pre_fw_hook",
    "_post_fw_hook",
    "_pre_bw_hook",
    "_post_bw_hook",
    "_track",
    "_update_peak_stats",
    "_track_optimizer_states",
)
"""MemTracker's methods that run inside the training step (module hooks, the dispatch
mode's bookkeeping, the optimizer hooks): a failure in one of them is the tracker's."""


_Own = mem_tracker._RefType("_Own", {name: name for name in OWN_CATEGORIES})
"""Our categories beside torch's (:data:`OWN_CATEGORIES`), as torch's tracker files tensors:
members of a ``_RefType``, whose value is the name the snapshots and result.json show."""
_BUCKET = _Own(BUCKET)
"""A strategy's communication buckets (DDP's all-reduce, ShardedDDP's reduce)."""
_DEVICE_QUERY = torch.ops.prim.device.default
"""``tensor.device``, dispatched where the tensor is a subclass that answers it in Python
(a fake tensor): :meth:`PeakTracker._device_query`."""


class PeakTracker(mem_tracker.MemTracker):
    """torch's MemTracker, keeping the overall peak only, and made safe to train under.

    ``limit_mib``: a budget (``trainer.memory_limit_mib``). When the live total first goes
    over it, what was live then is kept in :attr:`over_limit` (by category, by module, and
    the phase); each new storage is then filed under the module whose forward or backward
    allocated it (the innermost one running), which costs a little per allocation.
    ``filed_as``: which of our categories (:data:`OWN_CATEGORIES`) the tensors made now are
    filed under, or None for torch's own filing; :func:`sharded_exp.measure.tracker.filed_as`
    sets what it reads.

    - Its per-module peaks walk every module at every op (7x slower on a 32-layer model)
      and nothing here reads them: only the overall peak is kept.
    - Gradient accumulation calls the root module again before the step ends, which torch
      refuses ("multiple iterative calls"): the per-module stats are dropped instead.
    - A frozen parameter (``requires_grad=False``) cannot take the gradient hook torch puts
      on every parameter: only trainable ones are hooked (a frozen one has no gradient).
    - ``skip_views_of_unseen`` (the probe's window, which starts mid-training): a view op
      whose result lives in a storage the tracker does not know (allocated before the
      window: a row of a ``TensorDataset`` the DataLoader takes inside it) allocates
      nothing, and is not counted. torch's tracker counts the whole storage as a new
      activation, live as long as the dataset: a 2 MiB dataset made a 1 MiB Lightning step
      measure 3 MiB. Off for runs and fake steps (their tracker starts before the build):
      there such a view is memory a backend allocated out of sight, gloo's copy of a
      reduce-scatter's input (split into chunks after the collective was issued), which
      must count.
    - Measuring never breaks training: a failure inside any of its hooks switches the
      tracker off for the rest of the region and is kept in :attr:`failure`; the training
      step goes on untouched. The op itself (the real work) is never run twice.
    """

    def __init__(
        self,
        limit_mib: float | None = None,
        filed_as: Callable[[], str | None] = lambda: None,
        skip_views_of_unseen: bool = False,
    ):
        super().__init__()
        self._filed_as = filed_as
        self.phase_peaks: dict[tuple, dict] = {}
        """The peak snapshot of each phase, by (device, "optimizer" or "step"): another
        rank's peak may fall in the other phase (a fake step reads both)."""
        self.failure: str | None = None
        """Why the tracker stopped measuring (``Type: message``), or None."""
        self.limit_bytes = limit_mib * MIB if limit_mib else None
        self.over_limit: dict | None = None
        """What was live when the total first went over ``limit_mib`` (see :meth:`_capture`)."""
        self.module_names: dict[int, str] = {}
        """id(module) -> its name in the model (filled by :meth:`name_modules`)."""
        self.freed_off_thread_max = 0
        """Bytes of the largest tensor another thread freed (see :meth:`_delete_callback`)."""
        self._thread = threading.get_ident()
        self._lock = threading.RLock()
        self.skip_views_of_unseen = skip_views_of_unseen
        self._in_view_op = False  # the op being dispatched returns a view of its input (and is skipped)
        self._fake_mode_at_entry = None  # the fake mode the tracker was entered under (None in a run)
        for name in _GUARDED:
            setattr(self, name, self._guarded(getattr(self, name)))

    def _register_global_optimizer_hook(self) -> None:
        """torch's hooks (its pre-hook sets ``_in_opt``: what is allocated until the step ends
        is optimizer state), and one of ours after them: a closure handed to ``step`` (Lightning
        hands every step its training step and backward as one) runs with ``_in_opt`` unset, so
        its activations, gradients and temporaries are filed as a step's, not as optimizer
        state. torch's deregistration removes all three handles."""
        super()._register_global_optimizer_hook()

        def closure_outside_the_step(optimizer, args, kwargs):
            if kwargs.get("closure") is not None:
                return args, {**kwargs, "closure": self._outside_step(kwargs["closure"])}
            if len(args) > 1 and callable(args[1]):  # step(closure), positional (args[0]: the optimizer)
                return (args[0], self._outside_step(args[1]), *args[2:]), kwargs
            return None

        handle = register_optimizer_step_pre_hook(closure_outside_the_step)
        self._optimizer_hook_handles = (*self._optimizer_hook_handles, handle)

    def _outside_step(self, closure):
        @functools.wraps(closure)
        def call(*args, **kwargs):  # torch's closures take none; an optimizer may pass some
            inside, self._in_opt = self._in_opt, False
            try:
                return closure(*args, **kwargs)
            finally:
                self._in_opt = inside

        return call

    def _guarded(self, method):
        def call(*args, **kwargs):
            if self.failure is not None:
                return None
            try:
                return method(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 -- the measurement fails, not the step
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                self.failure = f"{type(exc).__name__}: {first}"
                return None

        return call

    def _update_peak_stats(self, peak_state) -> None:
        phase = "optimizer" if self._in_opt else "step"
        for dev, snap in self._curr_mem_snap.items():
            total = snap[mem_tracker._TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)
            if self.phase_peaks.get((dev, phase), {}).get(mem_tracker._TOTAL_KEY, 0) < total:
                self.phase_peaks[(dev, phase)] = dict(snap)
            if self.limit_bytes is not None and self.over_limit is None and total > self.limit_bytes:
                try:
                    self.over_limit = self._capture(dev, snap)
                except Exception as exc:  # noqa: BLE001 -- the breakdown fails, not the peak
                    self.over_limit = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def _delete_callback(self, winfo, w_st) -> None:
        # A tensor handed to a collective is freed by whichever thread drops it last: on
        # gloo, now and then its worker thread, after the training thread moved on. Until
        # then it is live (really: its memory is not free), so a peak can hold one such
        # buffer more than the program's order says; the largest is kept as a figure.
        if threading.get_ident() != self._thread:
            self.freed_off_thread_max = max(self.freed_off_thread_max, winfo.mem_consumed)
        with self._lock:  # the snapshot's sums are read-modify-write, from two threads
            super()._delete_callback(winfo, w_st)

    def _update_snap(self, u_type, winfo, *args, **kwargs) -> None:
        with self._lock:
            snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
            snap.setdefault(winfo.reftype, 0)  # our own categories (_Own) beside torch's
            super()._update_snap(u_type, winfo, *args, **kwargs)
        if self.limit_bytes is not None and u_type == mem_tracker._UpdateType.ADD:
            # The deepest module running (names are dotted paths from the root), or Global
            # when none runs (Global ranks below the root, which has no dot either).
            winfo.owner = max(self._mod_tracker.parents, key=lambda name: (name.count("."), name != "Global"))

    def end_of_build(self, module: nn.Module, optimizers) -> dict[str, float]:
        """The build is over: its peak by category (bytes, ``Total`` included), then the
        model's states filed as such (built inside the window, torch filed them as
        activations), every other tensor still live filed as :data:`BUCKET` (what the
        strategy allocated to communicate), and the peak started afresh."""
        found = {dev: {str(getattr(k, "value", k)): v for k, v in snap.items()}
                 for dev, snap in self.get_tracker_snapshot("peak").items()}  # fmt: skip
        self.track_external(module, *optimizers)
        loose = {mem_tracker._MemRefType.ACT, mem_tracker._MemRefType.TEMP, mem_tracker._MemRefType.OTH}
        for winfo, _ in list(self._WINFO.values()):
            if winfo.reftype in loose:
                old, winfo.reftype = winfo.reftype, _BUCKET
                self._update_snap(mem_tracker._UpdateType.REF, winfo, old_reftype=old)
        self.restart_peak()
        return found

    def restart_peak(self) -> None:
        """The peak starts afresh from what is live now."""
        current = self.get_tracker_snapshot("current")
        self._peak_mem_snap = current
        self._peak_mem = {dev: snap.get(mem_tracker._TOTAL_KEY, 0) for dev, snap in current.items()}
        self.phase_peaks.clear()

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        # A gradient that is a view into a communication bucket (ShardedDDP's; DDP's with
        # gradient_as_bucket_view) stays filed as the bucket it lives in: one storage.
        if reftype != _BUCKET:
            for st in mem_tracker.get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype == _BUCKET:
                    return {winfo}
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def __enter__(self):
        if not getattr(self, "_depth", 0):  # the outermost entry's mode (as torch 2.13's tracker keeps it)
            self._fake_mode_at_entry = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            return self._device_query(func, types, args, kwargs)
        if active_fake_mode() is not self._fake_mode_at_entry:
            # DTensor's sharding propagation: an op run again on fake tensors of another fake
            # mode to learn its output's shape, which allocates nothing (torch 2.13's tracker
            # skips these itself; 2.11's counted them: FSDP2's foreach Adam step +4 fp32 copies
            # of the shard, a GPU round's fsdp bf16 peak predicted 23.5% high).
            return func(*args, **(kwargs or {}))
        outer = self._in_view_op
        self._in_view_op = self.skip_views_of_unseen and bool(getattr(func, "is_view", False))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._in_view_op = outer

    def _device_query(self, func, types, args, kwargs):
        """``tensor.device`` asked of a fake tensor, which answers it in Python: two in three
        of the ops a fake step dispatches, most of them from autograd's engine. It makes no
        tensor, so the device is returned and the peak brought up to date, as the full
        dispatch below does for an op that makes none, without its walk over the result (a
        third of a 7B GPT's fake step went to these)."""
        device = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_at_entry:
            self._update_peak_stats(None)
        return device

    def _track(self, reftype, tensor) -> None:
        if self._in_view_op and not any(st in self._WINFO for st in mem_tracker.get_untyped_storages(tensor)):
            return  # a view into memory allocated before the window: nothing new (see the class docstring)
        category = self._filed_as()
        super()._track(reftype if category is None else _Own(category), tensor)

    def track_external(self, *external) -> None:
        """torch's ``track_external``, and the storages FSDP2 gathers each unit's parameters
        into (:func:`fsdp2_gathered`): allocated at the first step and resized to nothing and
        back at every step since (``UntypedStorage.resize_``, which the tracker follows only
        for storages it knows), so a window that starts later would never see the gathered
        parameters. Filed as activations, as a run's tracker (started before the first
        forward, which allocates them) files them. Empty for a model without FSDP2, or one
        that has not run its first forward (a run's or a fake step's)."""
        super().track_external(*external)
        for obj in external:
            if isinstance(obj, nn.Module):
                for tensor in fsdp2_gathered(obj):
                    self._update_and_maybe_create_winfos(tensor, mem_tracker._MemRefType.ACT)

    def name_modules(self, model: nn.Module) -> None:
        """Name modules as the model does (``layers.0.attn``), not by the wrapper's path."""
        self.module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

    def _capture(self, dev, snap) -> dict:
        """Live bytes now: by category, and by the module that allocated them."""
        if self._in_opt:
            phase = "optimizer"
        elif self._mod_tracker.is_bw:
            phase = "backward"
        elif set(self._mod_tracker.parents) - {"Global"}:
            phase = "forward"
        else:
            phase = "other"  # outside any module and the optimizer: the loss, clipping, communication
        # ModTracker's names run from the root it saw first (the wrapper): map them back.
        ours = {name: self.module_names.get(id(m), name) for m, name in self._mod_tracker._known_modules.items()}
        by_module: dict[str, int] = {}
        for winfo, _ in list(self._WINFO.values()):
            if winfo.device == dev:
                owner = getattr(winfo, "owner", "Global")
                by_module[owner] = by_module.get(owner, 0) + winfo.mem_consumed
        outside = by_module.pop("Global", 0)
        top = sorted(by_module.items(), key=lambda kv: -kv[1])[:TOP_MODULES]
        return {
            "phase": phase,
            "tracked_mib": snap[mem_tracker._TOTAL_KEY] / MIB,
            "by_category_mib": {
                str(getattr(k, "value", k)): v / MIB for k, v in snap.items() if k != mem_tracker._TOTAL_KEY
            },
            "top_modules_mib": {ours.get(name, name): b / MIB for name, b in top},
            "other_modules_mib": sum(by_module.values()) / MIB - sum(b for _, b in top) / MIB,
            "outside_modules_mib": outside / MIB,
        }

    def _pre_fw_hook(self, module, inputs) -> None:
        # The root module called again in forward: the next micro-batch of the same step
        # (gradient accumulation). Its per-module stats are not read: start them afresh.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch would hook every parameter, and a frozen one refuses a hook: hook only
        # the trainable ones, the way torch does (the gradient made, then accumulated).
        found = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_seen),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_seen(p.grad)),
                    )
        return found

    def _grad_seen(self, grad: torch.Tensor) -> None:
        if self.failure is None:
            try:
                self._update_and_maybe_create_winfos(grad, mem_tracker._MemRefType.GRAD)
            except Exception as exc:  # noqa: BLE001 -- as in _guarded
                self.failure = f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def fail_in_hooks(message: str) -> None:
    """Make every MemTracker in this process raise ``message`` inside its forward hooks from
    now on (the testing aid ``SHARDED_EXP_FAULT=tracker_error``, :mod:`sharded_exp.train.faults`):
    the tracker must switch itself off and the run go on."""

    def broken(self, args):
        raise RuntimeError(message)

    mem_tracker.MemTracker._track_inputs_or_outputs = broken  # this process only


def fsdp2_gathered(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 all-gathers each of ``model``'s units' parameters into (private torch
    API: ``FSDPParam.all_gather_outputs`` of each unit's param group; the gathered parameters
    are views of them), kept from step to step with their storage freed between uses. Empty
    where FSDP2 was never imported (no unit can exist) or no unit has gathered yet."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []
    # lazy: FSDP, imported only where the user's model or the run imported it
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                found.extend(param.all_gather_outputs)
    return found
