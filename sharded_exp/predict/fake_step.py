"""Predict a job's peak memory and FLOPs by running it: one fake training step.

The configured model is built under ``FakeTensorMode`` (tensors with shapes, dtypes and
devices but no storage: a 7B model costs nothing), wrapped by the configured strategy's
own ``build`` inside a fake process group of the planned world size, and trained for two
steps with the real :func:`~sharded_exp.train.trainer.train_step` (the optimizer state
appears at the first step, so the second is the steady one). torch's ``MemTracker``
follows every tensor as the CPU measurement of a real run does (started before the
strategy wraps the model; under FSDP2 too: ``FSDPMemTracker`` finds the same peak, more
slowly, and the gathered parameters are the tracked parameters beyond the resident
shards), and
``FlopCounterMode`` counts the FLOPs of the second step. Any model works: ours, Hugging
Face's, a user's ``_target_``.

What a fake step cannot do, it says (:attr:`StepEstimate.method`, ``note``):

- the grad scaler is off (its skip decision reads a value; the scaling itself is a
  scalar multiply and its memory a few scalars);
- fairscale OSS's clipping branches on the norm's value: the step is then retried
  without clipping (which scales gradients in place: no memory);
- a strategy that still cannot run fake falls back to the analytic model states of
  that strategy plus the activations and temporaries of DDP's fake step;
- a model that cannot run fake (data-dependent control flow) gets no peak prediction,
  and the reason is recorded;
- a Hugging Face model's attention mask path is chosen from the mask's values, which a
  fake batch lacks: for data that never pads the step is told so (:func:`unpadded_masks`),
  and data that may pad is faked with the mask, as transformers builds it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.distributed import distributed_c10d
from torch.distributed.fsdp._fully_shard import _fsdp_param  # private torch API: re-check on torch upgrades
from torch.distributed.tensor import _sharding_prop  # private torch API: re-check on torch upgrades
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from sharded_exp.config import JobGroups
from sharded_exp.data import each_tensor, probe_task
from sharded_exp.errors import ConfigError
from sharded_exp.measure.cuda_kernels import cuda_kernels
from sharded_exp.measure.tracker import peak_tracker
from sharded_exp.models import units
from sharded_exp.models.materialise import chunk_of
from sharded_exp.predict.alloc_trace import recording
from sharded_exp.predict.op_trace import Trace, tracing
from sharded_exp.strategies import STRATEGIES, baseline, memory_of, offloads_to_host, traits_of
from sharded_exp.train.build import build_run
from sharded_exp.train.levers import without_checkpointing
from sharded_exp.train.step import train_step
from sharded_exp.vocabulary.memory import TORCH_CATEGORIES, TOTAL, in_our_names

MIB = 2**20


@dataclass
class StepEstimate:
    """What one fake step of one rank found."""

    rank: int
    """The rank simulated."""
    peak_mib: float
    """Live tensors at the peak of the two steps, model states included."""
    breakdown_mib: dict[str, float]
    """The peak by kind: params, grads, optimizer, gathered, buckets, activations,
    temporaries, communication, other."""
    flops_per_step: int
    """FLOPs of one optimizer step of this rank (every micro-batch, forward and backward)."""
    method: str
    """``fake step``, ``fake step without clipping`` or ``ddp fake step + analytic states``."""
    note: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A process group of ``world_size`` ranks whose collectives do nothing, in this process."""
    if dist.is_initialized():
        raise RuntimeError("a fake step needs a process without a process group (one is initialised here)")
    hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank<r>]:", once per call
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # A fake collective does nothing: it is complete once issued, as a real one is soon
    # after. torch's FakeWork says never, and code that frees memory on completion
    # (fairscale ShardedDDP's reduce callbacks drop the gradients a rank does not own)
    # would then never free it.
    work = torch._C._distributed_c10d.FakeWork
    never = work.is_completed
    work.is_completed = lambda self: True
    try:
        yield
    finally:
        work.is_completed = never
        dist.destroy_process_group()
        sys.excepthook = hook


MOD_TRACKER_WARNING = r"The module hierarchy tracking maybe be messed up\. Please file a bug to PyTorch"
"""The start of torch ModTracker's warning when a module is entered while it still counts it
as active (torch.distributed._tools.mod_tracker, torch 2.13)."""


@contextlib.contextmanager
def _mod_tracker_warning_quiet():
    """torch's ModTracker, inside MemTracker, warns "... Please file a bug to PyTorch" when a
    module is entered again while it still counts it as active, as in a Hugging Face Llama's fake
    step (a plan of one printed it, and more than once). It counts such
    a re-entry itself (``_active_module_cnt``), and our tracker reads from it only whether any
    module is active (the phase) and which one allocated (the owner): the warning asks the user
    to report what they cannot act on. Filtered for the fake step only, by its message, so any
    other warning still shows. When it fires, ModTracker also replaces ``warnings.formatwarning``
    for the whole process; that is put back too."""
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MOD_TRACKER_WARNING, category=UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning


@contextlib.contextmanager
def _separate_propagation_mode():
    """DTensor computes each op's output shape by running it once more on fake tensors, in
    the active fake mode if there is one, else in a fresh one. Real runs get the fresh one,
    which MemTracker ignores; in a fake step that would be ours, and each such run would be
    counted as memory (optimizer steps over FSDP's DTensors: +50% of optimizer state). So it
    gets a fake mode of its own here too."""
    own = FakeTensorMode()
    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


def _gqa_refused() -> bool:
    """Whether this torch's attention FLOP formulas refuse grouped-query attention (fewer key
    and value heads than query heads): they do before torch 2.13."""
    try:
        flop_counter.sdpa_flop_count((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        return True
    return False


@contextlib.contextmanager
def _gqa_attention_flops():
    """Grouped-query attention counted as torch 2.13 counts it, on any torch: its kernels
    broadcast each key and value head to the query heads that share it, so its FLOPs are
    those of the same attention with them repeated. Before 2.13 torch's formulas refuse the
    shapes (an AssertionError: every fake step of a Llama or Qwen2 with fewer key/value heads
    failed there); they are given the broadcast shapes here."""
    if not _gqa_refused():
        yield
        return
    forward, backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count

    def broadcast(query_shape, *shapes):
        heads = query_shape[1]
        return [(s[0], heads, *s[2:]) if s[1] and heads % s[1] == 0 else s for s in shapes]

    flop_counter.sdpa_flop_count = lambda q, k, v: forward(q, *broadcast(q, k, v))
    flop_counter.sdpa_backward_flop_count = lambda g, q, k, v: backward(g, q, *broadcast(q, k, v))
    try:
        yield
    finally:
        flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count = forward, backward


GRAPH_CAPTURE_CHECKS = ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")
"""The optimizer's check for a CUDA graph being captured: its name on torch 2.11 and 2.13, and
its older name (a torch has either; both are left out where present)."""


@contextlib.contextmanager
def _no_graph_capture_check():
    """An optimizer's ``step`` first asks whether the accelerator's current stream is capturing
    a CUDA graph (:data:`GRAPH_CAPTURE_CHECKS`), a call that starts CUDA on a machine with a
    GPU: in a GPU run's pre-flight, a CUDA context (hundreds of MiB of the GPU, refused
    outright on a GPU another job holds in exclusive-process mode) for a step of fake CPU
    tensors that no graph captures. The check only ever refuses a capture, so the fake step
    leaves it out."""
    own = vars(torch.optim.Optimizer)
    saved = {name: own[name] for name in GRAPH_CAPTURE_CHECKS if name in own}
    for name in saved:
        setattr(torch.optim.Optimizer, name, lambda self: None)
    try:
        yield
    finally:
        for name, check in saved.items():
            setattr(torch.optim.Optimizer, name, check)


class _Chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty pieces to ``n``, as FSDP2's
    ``_chunk_with_empty`` returns it, but each piece made only when it is read: FSDP reads
    its own rank's piece and the first, and on fake tensors making all ``n`` costs a fake
    tensor each (64 ranks: most of a fake step's build)."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self.n <= index < self.n:
            raise IndexError(index)
        piece = chunk_of(self.tensor, self.n, self.dim, index % self.n)
        return piece if piece.numel() or piece.size(self.dim) else piece.new_empty(0)

    def __iter__(self):
        return (self[i] for i in range(self.n))


@contextlib.contextmanager
def _lazy_fsdp_chunks():
    """FSDP2 cuts each parameter into one piece per rank when it shards it; in a fake step
    only the pieces it reads are made (:class:`_Chunks`: the same shapes, views of the same
    storage, so the same memory)."""
    eager = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = eager


class GlooReduceScatter:
    """The kernel rule of gloo's reduce-scatter, in a fake step of a CPU run.

    torch's gloo backend reduces a copy of a reduce-scatter's input, not the input itself:
    ``c10d._reduce_scatter_base_`` copies the input (in C++, out of the tracker's sight),
    splits the copy into one chunk per rank, reduces them and copies this rank's chunk into
    the output. A CPU tracker sees the split chunks' storage, input-sized, as a temporary:
    measured +67,072 B, the whole of the unit's 2 x 8,384 float32 gradient, in the backward
    of ``strategy=fsdp model.hidden=128 model.depth=2``, which is that run's peak; and for a
    bare ``dist.reduce_scatter_single`` at 1, 2 and 3 ranks, float32 and bfloat16 alike,
    always the input's bytes. The copy goes when the collective's last reference does: most
    often as it returns, now and then later, when gloo's worker thread drops it (the
    tracker's ``freed_off_thread_max_mib``).

    The fake process group's collectives allocate nothing, so here each reduce-scatter holds
    a fake copy of its input until it returns, tracked as the real one is (an asynchronous
    one, ``async_op=True``, which FSDP2 does not issue, is held until it returns, not until
    its wait). FSDP2's gradient reduce-scatter (HSDP's and ``fsdp_grad_op``'s too) is the
    one our strategies issue. NCCL (a GPU run) allocates no such copy, and gloo's all-gather
    and all-reduce copy nothing (checked the same way)."""

    MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
    """Where the collective is looked up: by ``dist.`` (FSDP2) and inside c10d (on torch 2.13,
    ``reduce_scatter_tensor`` and ``_reduce_scatter_base`` call ``reduce_scatter_single``),
    once per collective."""
    NAME = "reduce_scatter_single" if hasattr(distributed_c10d, "reduce_scatter_single") else "reduce_scatter_tensor"
    """The function every reduce-scatter of a tensor goes through: ``reduce_scatter_single``
    since torch 2.13; before, ``reduce_scatter_tensor`` (which FSDP2 calls, and
    ``_reduce_scatter_base`` too)."""

    def __init__(self) -> None:
        self.count = 0
        """Reduce-scatters that held their copy (a prediction names the rule when > 0)."""
        self._saved: list = []

    def _copying(self, collective):
        def reduce_scatter(output, input, *args, **kwargs):
            copy = input.clone()  # fake, and tracked: the bytes gloo's copy holds
            self.count += 1
            try:
                return collective(output, input, *args, **kwargs)
            finally:
                del copy

        return reduce_scatter

    def __enter__(self) -> "GlooReduceScatter":
        copying = self._copying(getattr(distributed_c10d, self.NAME))
        for name in self.MODULES:
            module = importlib.import_module(name)
            self._saved.append((module, getattr(module, self.NAME)))
            setattr(module, self.NAME, copying)
        return self

    def __exit__(self, *exc) -> None:
        for module, collective in reversed(self._saved):
            setattr(module, self.NAME, collective)
        self._saved.clear()


MASK_RULES = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
"""transformers' ``masking_utils`` functions (5.x) that read a 2-D attention mask's values to
decide whether SDPA gets a mask at all; their first argument is that mask."""


@contextlib.contextmanager
def unpadded_masks(padded: bool):
    """A Hugging Face model's attention as a real run calls it on batches without padding.

    transformers reads the ``attention_mask``'s values to pick SDPA's path: when every token is
    attended (and the query is the whole sequence) it builds no mask and calls SDPA with
    ``is_causal=True``; with padding it builds a batch x 1 x seq x seq mask and calls SDPA
    non-causal with it. A fake tensor has no values, so transformers takes the second path for
    every batch (it treats a fake mask as one it may not read, as under ``torch.export``): the
    fake step held a mask and priced a non-causal attention (twice a causal kernel's work)
    where the real run of a causal LM holds none and runs the causal kernel.

    When the task's batches never pad (``padded`` False: :attr:`sharded_exp.data.Task.padded`),
    each rule in :data:`MASK_RULES` is asked here as for a batch without padding: with no
    padding mask, so transformers' own rule still decides the rest (a sliding window, a
    query shorter than its keys, packed sequences all keep their mask). Nothing changes for
    a task that may pad, or when transformers was not imported (the model is none of its)."""
    masking = sys.modules.get("transformers.masking_utils")
    rules = [(name, getattr(masking, name, None)) for name in MASK_RULES] if masking is not None else []
    if padded or not rules:
        yield
        return

    def without_padding(rule):
        def asked(padding_mask, *args, **kwargs):
            if isinstance(padding_mask, FakeTensor):
                padding_mask = None  # the batch pads nothing: the mask's values are all ones
            return rule(padding_mask, *args, **kwargs)

        return asked

    saved = [(name, rule) for name, rule in rules if rule is not None]
    for name, rule in saved:
        setattr(masking, name, without_padding(rule))
    try:
        yield
    finally:
        for name, rule in saved:
            setattr(masking, name, rule)


def _breakdown(tracker, device: torch.device) -> tuple[float, dict[str, float]]:
    return _parts(_on(tracker.get_tracker_snapshot("peak"), device))


def _phases(tracker, device: torch.device) -> dict[str, tuple[float, dict[str, float]]]:
    """The peak of the forward/backward ("step") and of the optimizer step on ``device``, each
    broken down (a CUDA step also holds a few bytes on the CPU: Adam's ``step`` counters)."""
    devices = list(dict.fromkeys(dev for dev, _ in tracker.phase_peaks))
    if device.index is None:
        device = next((d for d in devices if d.type == device.type), devices[0] if devices else device)
    return {phase: _parts(snap) for (dev, phase), snap in tracker.phase_peaks.items() if dev == device}


def _parts(values: dict) -> tuple[float, dict[str, float]]:
    """The tracker's total and its split (bytes by torch's category) in MiB, in our names
    (:func:`~sharded_exp.vocabulary.memory.in_our_names`), every one of ours present."""
    mib = {str(getattr(key, "value", key)): nbytes / MIB for key, nbytes in values.items()}
    total = mib.pop(TOTAL, 0.0)
    return total, {**dict.fromkeys(TORCH_CATEGORIES.values(), 0.0), **in_our_names(mib)}


META_FIRST_SIGNS = ("Couldn't swap",)
"""Build failures under FakeTensorMode that building on meta first avoids. (Not a torch
built without CUDA faking a CUDA device: DDP's C++ reducer then aborts the process.)"""


class FakeStepError(RuntimeError):
    """A fake step failed; the message says which part failed: building the model, the
    strategy wrapping it, the model's or the strategy's step, or the memory tracker."""

    def __init__(self, part: str, exc: BaseException, detail: str | None = None):
        self.part = part
        self.cause = exc
        super().__init__(f"{part}: {detail or _short(exc)}")


def refuse_parameters_made_in_forward(
    module: torch.nn.Module, known: dict[str, int], model: str, strategy: str, failed: bool = False
) -> None:
    """A parameter that the model's forward registers (not its constructor) is in no
    optimizer (never trained) and in no FSDP unit (a plain tensor among DTensors): refused,
    naming it. ``known``: the name and ``id`` of each parameter the build made.

    After a step that ran, every parameter must be the object the build made, a new one
    under an old name included (the optimizer holds the old one). After a step that
    ``failed``, only new names count: FSDP2 registers a unit's gathered parameters in place
    of its sharded ones while the unit runs, and a step that fails inside one (of any cause)
    leaves them there, which is no parameter the forward made."""
    if failed:
        made = [name for name, _ in module.named_parameters() if name not in known]
    else:
        made = [name for name, param in module.named_parameters() if known.get(name) != id(param)]
    if made:
        raise ConfigError(
            f"model={model}: its forward creates the parameter{'s' if len(made) > 1 else ''} {', '.join(made)} "
            f"(not its constructor): the optimizer never sees {'them' if len(made) > 1 else 'it'}, so under "
            f"strategy={strategy} {'they are' if len(made) > 1 else 'it is'} never trained (and FSDP cannot shard it); "
            "create every parameter in __init__"
        )


def _blame(exc: BaseException, module) -> str:
    """Who raised ``exc`` inside a fake training step: the model's own code (the deepest
    frame outside torch lies in the model's module file), the strategy, or the step."""
    model_files = set()
    for cls in type(module).__mro__ if module is not None else ():
        try:
            model_files.add(inspect.getsourcefile(cls))
        except TypeError:
            pass
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    last = frames[-1] if frames else ""
    if last in model_files:
        return "the model cannot run under FakeTensorMode"
    if "/strategies/" in last or "fairscale" in last:
        return f"strategy={'{}'} cannot run its step under FakeTensorMode"
    return "the training step cannot run under FakeTensorMode"


class _Watch:
    """The memory tracker of one fake step and the build's hooks that start it and mark the
    build's end (as a CPU run measures: from before the strategy allocates its buffers).

    ``memory=False`` (a trace-only step): no tracker is made or started; the hooks only note
    that the build got as far as the strategy's wrap."""

    def __init__(self, device: torch.device, allocs=None, memory: bool = True, shards: bool = True):
        self.device = device
        self.allocs = allocs
        """What the CUDA allocator is asked (:func:`sharded_exp.predict.alloc_trace.recording`), or None."""
        self.shards = shards
        """The strategy shards parameters (FSDP): its units are drawn in host memory after the wrap."""
        self.restarted = False
        self.tracker = peak_tracker() if memory else None
        self.built: list = []
        self.tracking = False
        self.build: dict = {}

    def start_tracker(self, module) -> None:
        self.built.append(module)
        if self.tracker is None:
            return
        try:
            if self.allocs is not None:
                self.allocs.attach(self.tracker)
            self.tracker.track_external(module)
            self.tracker.__enter__()
        except Exception as exc:  # noqa: BLE001
            raise FakeStepError("the memory tracker (torch MemTracker) could not start", exc) from exc
        self.tracking = True

    def wrapping(self, module) -> None:
        """A strategy that does not shard parameters wraps a model a run has drawn in host
        memory and moved to the device (sharded_exp/models/materialise.py): the device's trace
        starts here, from the parameters and buffers, so that what the wrap allocates and frees
        on the device is in it (fairscale OSS's flat buffers, which replace the parameters; not
        DDP's broadcast of its states from rank 0, which the fake step skips)."""
        if self.allocs is not None and not self.shards:
            self.allocs.restart(hold_frees=True)
            self.restarted = True

    def end_of_build(self, strategy) -> None:
        # The build's peak apart (a sharded build: the shards and one whole unit), then the
        # strategy's buckets filed as such, and the training's peak from here.
        if self.allocs is not None and not self.restarted:
            self.allocs.restart()  # a sharded build's units drawn in host memory: the device's trace starts here
        elif self.allocs is not None:
            self.allocs.release_held()
        if self.tracking:
            found = self.tracker.end_of_build(strategy.module, strategy.local_optimizers())
            self.build.update(zip(("peak_mib", "breakdown_mib"), _parts(_on(found, self.device))))

    def stop(self) -> None:
        if self.tracking:
            self.tracker.__exit__(None, None, None)
            self.tracking = False


def _build(cfg: JobGroups, device: torch.device, watch: _Watch):
    """The run built under the fake mode (shapes only: model.pretrained's config, never its
    weights); a model that converts itself while built is built on meta first. Raises
    :class:`FakeStepError` naming the part that failed."""
    hooks = dict(before_wrap=watch.start_tracker, after_build=watch.end_of_build, wrapping=watch.wrapping,
                 compile=False, weights=False)  # fmt: skip
    try:
        try:
            with device:  # built on the (fake) device, as a real run's model ends up
                return build_run(cfg, device, with_task=False, **hooks)
        except Exception as exc:  # noqa: BLE001
            text = "".join(traceback.format_exception(exc))
            if watch.built or not any(sign in text for sign in META_FIRST_SIGNS):
                raise
            # A model that converts itself while being built (``.double()``) cannot under
            # FakeTensorMode (torch's _apply cannot swap a fake parameter): built on meta,
            # its tensors then made fake.
            with device:
                return build_run(cfg, device, with_task=False, meta_first=True, **hooks)
    except FakeStepError:
        raise
    except Exception as exc:  # noqa: BLE001 -- which part failed is named
        part = (
            f"strategy={cfg.strategy.name} cannot wrap the model under FakeTensorMode"
            if watch.built
            else "the model cannot be built under FakeTensorMode"
        )
        raise FakeStepError(part, exc) from exc


def _steps(cfg: JobGroups, run, sample: dict, watch: _Watch, kernels, grad_clip: float, flops: bool, trace=None) -> int:
    """Two fake training steps of ``run`` (three with checkpointing and ``flops``); returns
    the FLOPs of one step (0 when not counted). ``trace``: a :class:`Trace` the second (steady)
    step's ops are recorded into, recomputation included."""
    tc, device, name = cfg.trainer, watch.device, cfg.strategy.name
    module, strategy, autocast = run.module, run.strategy, run.autocast
    known = {name: id(param) for name, param in module.named_parameters()}
    strategy.scaler = torch.amp.GradScaler(device.type, enabled=False)
    count = 0
    # FlopCounterMode's module hooks keep a checkpointed unit's recomputed tensors alive
    # longer (+25% on a GPT with full AC): with checkpointing, FLOPs are counted in a third
    # step, after the memory window, without recomputation (the model's FLOPs, as MFU counts
    # them); otherwise in the second.
    checkpointing = str(tc.activation_checkpointing) != "none"
    counted = 2 if checkpointing else 1
    for step in range(3 if flops and checkpointing else 2):
        if step == 2:
            watch.stop()
        # Made inside the window, as in a run, so counted like it (a value that is no
        # tensor, a user's list or string, passes as the probe had it).
        batches = [
            each_tensor(sample, lambda v: torch.zeros((tc.batch_size, *v.shape[1:]), dtype=v.dtype, device=device))
            for _ in range(tc.grad_accum)
        ]
        counter = FlopCounterMode(display=False) if step == counted and flops else None
        if kernels is not None:
            kernels.flops = 0
        plain = without_checkpointing() if step == 2 else contextlib.nullcontext()
        traced = tracing(trace if step == 1 else None, units(module), kernels)
        try:
            with counter or contextlib.nullcontext(), plain, traced:
                train_step(strategy, batches, autocast, grad_clip)
        except Exception as exc:  # noqa: BLE001
            refuse_parameters_made_in_forward(module, known, cfg.model.name, name, failed=True)  # the likelier cause
            raise FakeStepError(_blame(exc, module).format(name), exc) from exc
        refuse_parameters_made_in_forward(module, known, cfg.model.name, name)
        if counter is not None:  # + fused attention's, which no aten op carries here
            count = counter.get_total_flops() + (kernels.flops if kernels is not None else 0)
        if watch.tracking:
            watch.tracker.reset_mod_stats()
        del batches
        if watch.allocs is not None and step < 2:
            watch.allocs.step_end()
    return int(count)


def _run(
    cfg: JobGroups,
    world_size: int,
    rank: int,
    device_type: str,
    grad_clip: float,
    flops: bool,
    trace=None,
    memory: bool = True,
) -> tuple:
    """Two fake steps of ``cfg`` on ``rank``: (peak MiB, breakdown, FLOPs of one step, extra:
    each phase's peak, the build's, and how many reduce-scatters held gloo's copy).
    ``memory=False``: the same steps without the memory tracker and the allocator's
    recording (peak NaN, breakdown and phases empty).

    Raises :class:`FakeStepError` naming the part that failed."""
    # Always fake CPU tensors: a step for a GPU runs as CUDA would (cuda_kernels), without
    # starting CUDA in this process (or aborting it, on a torch built without CUDA).
    device = torch.device("cpu")
    on_gpu = cuda_kernels() if device_type == "cuda" else contextlib.nullcontext(None)
    # One real sample says each batch tensor's dtype and per-sample shape; the batches
    # themselves are made fake (a batch too large for this machine is planned, not made).
    sample, padded = _probe(cfg.data, cfg.model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # A CPU run communicates over gloo, whose reduce-scatter holds a copy of its input.
    gloo = GlooReduceScatter() if device_type == "cpu" else contextlib.nullcontext(None)
    # What the CUDA allocator is asked, read from the memory tracker (so none without it).
    asked = (
        recording(device_type, memory_of(cfg.strategy.name).side_streams) if memory else contextlib.nullcontext(None)
    )
    with (
        fake_process_group(world_size, rank),
        _mod_tracker_warning_quiet(),
        _separate_propagation_mode(),
        _no_graph_capture_check(),
        _gqa_attention_flops(),
        _lazy_fsdp_chunks(),
        gloo as gloo_rule,
        asked as allocs,
        mode,
        on_gpu as kernels,
    ):
        watch = _Watch(device, allocs, memory, traits_of(cfg.strategy.name).shards_parameters)
        torch.manual_seed(cfg.trainer.seed)
        try:
            run = _build(cfg, device, watch)  # a Hugging Face model imports transformers here
            with unpadded_masks(padded):
                count = _steps(cfg, run, sample, watch, kernels, grad_clip, flops, trace)
        finally:
            watch.stop()
    copies = gloo_rule.count if gloo_rule is not None else 0
    tracker = watch.tracker
    if tracker is None:  # a trace-only step: no memory figures
        return float("nan"), {}, count, {"phases": {}, "build": {}, "gloo_reduce_scatters": copies}
    if tracker.failure is not None:
        failure = RuntimeError(tracker.failure)
        raise FakeStepError("the memory tracker (torch MemTracker) failed", failure, detail=tracker.failure)
    peak, parts = _breakdown(tracker, device)
    extra = {"phases": _phases(tracker, device), "build": watch.build, "gloo_reduce_scatters": copies}
    return peak, parts, count, extra | ({"alloc_events": watch.allocs.events} if watch.allocs is not None else {})


_PROBES: dict[str, tuple[dict, bool]] = {}


def _probe(data_cfg, model_cfg) -> tuple[dict, bool]:
    """One sample's keys, dtypes and per-sample shapes (rank 0's: every rank's batch has the
    same layout), and whether the task's batches may pad (:attr:`sharded_exp.data.Task.padded`),
    made once per data and model config: a plan fakes many steps of one."""
    key = OmegaConf.to_yaml(data_cfg) + OmegaConf.to_yaml(model_cfg)
    if key not in _PROBES:
        task = probe_task(data_cfg, model_cfg)
        sample = each_tensor(task(0, 0, 0), lambda v: torch.empty((1, *v.shape[1:]), dtype=v.dtype, device="meta"))
        _PROBES[key] = sample, task.padded
    return _PROBES[key]


def _on(snapshots: dict, device: torch.device) -> dict:
    """The snapshot of ``device`` (of its type when it has no index) from ``{device: snapshot}``."""
    if device.index is None:
        return next((snap for dev, snap in snapshots.items() if dev.type == device.type), {})
    return snapshots.get(device, {})


def _data_dependent(exc: BaseException) -> bool:
    exc = getattr(exc, "cause", exc)
    return isinstance(exc, DataDependentOutputException) or "data-dependent" in str(exc).lower()


def _short(exc: BaseException) -> str:
    if isinstance(exc, FakeStepError):
        return str(exc)
    # every line, joined: a wrapped error (Hydra's "Error in call to target ...:") says
    # what went wrong only on its next line
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:400]}"


def fake_step(
    cfg: JobGroups,
    world_size: int,
    rank: int = 0,
    device_type: str = "cpu",
    states_mib=None,
    flops: bool = True,
    trace: bool = False,
    memory: bool = True,
) -> StepEstimate:
    """The peak of ``rank`` in a job of ``world_size`` ranks, from two fake steps.

    ``states_mib(strategy_name) -> MiB``: the analytic model states of ``rank`` under a
    strategy, used only by the fallback for a strategy that cannot run fake. Raises when
    the model itself cannot run fake (the caller records why). ``flops``: also count the
    FLOPs (about a third of the time on a large model; the planner needs none). ``trace``:
    also record the steady step's ops (:mod:`~sharded_exp.predict.op_trace`), in
    ``extra["trace"]`` (not for the fallback of a strategy that cannot run fake).
    ``memory=False``: a trace-only step, for the speed columns, which read only the trace and
    the FLOPs: the same steps run (the same ops recorded, the same FLOPs counted) without the
    memory tracker and the allocator's recording, whose figures the speed columns would throw
    away; its ``peak_mib`` is NaN, its breakdown empty, and a strategy that cannot run fake
    raises (the fallback is a memory figure).
    """
    if not memory and not trace:
        raise ValueError("fake_step(memory=False, trace=False) would find nothing: a step without memory "
                         "tracking is for its op trace; pass trace=True")  # fmt: skip
    t0 = time.perf_counter()
    if offloads_to_host(cfg.strategy):  # faked on the device; the states' move to the host is a rule
        cfg = cfg.copy()
        cfg.strategy.cpu_offload = False
    clip = float(cfg.trainer.grad_clip)
    known = clip > 0 and traits_of(cfg.strategy.name).clip_reads_values
    first: Exception | None = None
    if not known:
        try:
            recorded = Trace() if trace else None
            peak, parts, count, extra = _run(cfg, world_size, rank, device_type, clip, flops, recorded, memory)
            extra["trace"] = recorded
            return StepEstimate(rank, peak, parts, count, "fake step", seconds=time.perf_counter() - t0, extra=extra)
        except ConfigError:  # the model itself is refused: no fallback can fake it
            raise
        except Exception as exc:  # noqa: BLE001 -- decide below what a failure means
            first = exc
    if clip > 0 and (known or _data_dependent(first)):
        try:
            recorded = Trace() if trace else None
            peak, parts, count, extra = _run(cfg, world_size, rank, device_type, 0.0, flops, recorded, memory)
            extra["trace"] = recorded
            why = "on the norm's value" if known else f"on a value ({_short(first)})"
            note = f"{cfg.strategy.name}'s clipping branches {why}: step faked without it"
            seconds = time.perf_counter() - t0
            method = "fake step without clipping"
            return StepEstimate(rank, peak, parts, count, method, note, seconds, extra=extra)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            first = first or exc
    if cfg.strategy.name == baseline() or states_mib is None or not memory:
        raise first
    # The strategy cannot run fake: its own (analytic) model states, the baseline's (DDP's) activations.
    ddp_cfg = cfg.copy()
    ddp_cfg.strategy = STRATEGIES.config_class(baseline())()
    base = fake_step(ddp_cfg, world_size, rank, device_type, flops=flops)
    own, ddp = states_mib(cfg.strategy.name), states_mib(baseline())
    note = f"{cfg.strategy.name} cannot run under FakeTensorMode ({_short(first)})"
    parts = {**base.breakdown_mib, **own}
    return StepEstimate(
        rank,
        base.peak_mib - sum(ddp.values()) + sum(own.values()),
        parts,
        base.flops_per_step,
        "ddp fake step + analytic states",
        note,
        time.perf_counter() - t0,
    )
