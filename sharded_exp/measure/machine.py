"""The ``this`` device profile: the machine at hand, measured in a few seconds and cached.

What the time model needs of a device, measured the way a rank would see it (with the
threads one rank gets):

- matmul throughput per dtype at a few sizes (a measured curve: small matmuls are slower
  per FLOP than large ones);
- on CPU, the same for a linear layer's three matmuls (forward ``x @ W^T``, the input's and
  the weight's gradients), tall and with operands read from memory, per dtype a step computes
  in: a step's matmuls, which run slower than square ones served from the cache;
- attention's throughput (causal ``scaled_dot_product_attention``, forward and backward) at a
  few shapes: a fused attention kernel is not a matmul (on a CPU it reaches a small part of
  the matmul rate), so it gets its own curve;
- memory bandwidth (a large tensor copied: bytes read plus written over the time);
- the pace of the elementwise and per-row ops whose arithmetic, not their bytes, sets their
  time on a CPU (GELU, SiLU, sigmoid, tanh, exp, a cube, softmax, log-softmax, layer norm;
  forward and backward), as the bytes the op trace counts for them per second;
- the overhead of one op (a one-element add: on a CPU this dispatch cost dominates small ops);
- the host's cost per op of a training step: a tiny model's (8 x Linear(32, 32) + GELU,
  Adam, batch 8), whose ops do no work to speak of, each part timed and divided by its
  number of ops (those the time model counts, :func:`sharded_exp.speed.compute.timed_op`):
  the forward and backward per math dtype (fp32, and bf16/fp16 under autocast: the module
  calls, autograd's engine, autocast's casts, which a lone add is not), and the optimizer's
  step apart (fp32, outside autograd: a fraction of a forward or backward op's cost);
- the same for the tiny model under FSDP2 (each Linear and the root ``fully_shard``-ed, in a
  spawned world of one process): FSDP2's hooks, its all-gathers' copies, and DTensor's
  dispatch of the optimizer's ops, the host work an FSDP step adds per op;
- on CPU, the local "link": an all-reduce between two gloo processes on this machine (16 MiB
  for its bandwidth), and each kind of collective's 1 KiB call between them (its latency);
- on CPU, what a new page of memory costs when first written (a 64 MiB tensor made and
  filled, against the same fill of a tensor already resident): the kernel's fault and
  zeroing, paid by every block glibc maps anew (``measure/host_malloc.py``).

On a CUDA device (:func:`measure_cuda`) the same figures are measured on the GPU, in a child
process (the parent of a run never initialises CUDA): matmuls up to 8192 x 8192, a 1 GiB
device-to-device copy, and one small op's time (what a launch-bound op costs). Its MFU peaks
are the datasheet's for the device's name where it is known (the definition a run's
``mfu_pct`` uses), else the best matmul measured. A single GPU has no link to measure: a run on
several GPUs takes its link from the sourced profile of its device (``speed/profile_data``).

Each figure is the fastest of several timed windows: other work on the machine only slows a
window, so a busy moment does not become the machine's figure (which is cached). A busy
stretch longer than a figure's windows still would: the CPU other processes used while the
profile was measured is counted (:func:`cpu_elsewhere_s`, Linux), and a profile measured
while they took cores its threads needed is measured again (up to :data:`ATTEMPTS` times in
all), the least disturbed kept, and the figure it leaves said in the profile's source.

Cached per machine in the user cache dir (``$XDG_CACHE_HOME`` or ``~/.cache``), keyed by
host name, torch version, device and threads; ``plan.remeasure=true`` measures again.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import socket
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from sharded_exp.measure.flops import count_cpu_attention, gpu_peak, save_cache
from sharded_exp.measure.spawned import run_spawned
from sharded_exp.speed.compute import base_name, tensor_bytes, timed_op
from sharded_exp.speed.profiles import Curve, DeviceProfile, Figure, HostMemory, LinkProfile, Source

MATMUL_SIZES = (128, 256, 512, 1024)
"""Square matmul sizes measured (n x n by n x n)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COPY_BYTES = 64 * 2**20
ALL_REDUCE_BYTES = 16 * 2**20
LATENCY_ELEMENTS = 256
"""Floats in the all-reduce whose time is the link's latency (1 KiB: its bytes cost under a
microsecond at the link's bandwidth). Not one float: gloo's ring (``gloo/allreduce.cc``,
``ring``) cuts the buffer into at least 2 x ranks segments of whole elements and skips the
sends of empty ones, so one or two floats never travel in one of the two directions, and
on this VM such a call took 0.07-0.16 ms where 3 floats to 4 KiB took 0.3-2.2 ms
(2026-12-06, docs/concepts/speed.md)."""
_log = logging.getLogger(__name__)
SOURCE = Source("measured", "measured on this machine by sharded_exp.measure.machine", "(this machine)")


def _write_figures(out: str, figures: dict) -> None:
    """Write a child's figures whole (renamed into place): the parent reads ``out`` as soon as it exists."""
    with open(out + ".part", "w") as f:
        json.dump(figures, f)
    os.replace(out + ".part", out)


def _in_children(fn, args: tuple, nprocs: int, out: str, what: str) -> dict:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes (:func:`run_spawned`: never
    waited for forever) and return the figures they wrote to ``out`` (:func:`_write_figures`)."""
    run_spawned(fn, args, nprocs, lambda: os.path.exists(out), f"measuring {what}")
    with open(out) as f:
        return json.load(f)


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sharded_exp", "this_profile.json")


WINDOWS = 5
"""Each figure is timed in this many windows and the fastest kept: other work on the machine
only ever slows a window down, so the fastest is the machine's own pace (timeit's rule)."""


def _timed(fn, seconds: float) -> float:
    """Seconds per call of ``fn``: the fastest of :data:`WINDOWS` windows that share about
    ``seconds`` (after one warm-up call). A call longer than ``seconds`` is timed once, the
    warm-up itself: what a first call costs beyond the others (a kernel chosen, its output's
    pages faulted in) is lost in it, and each window would take that long again (fp16's
    1024 x 1024 matmul on a CPU without it in hardware: 2 s a call, 12 s for the windows)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > seconds:
        return first
    best = float("inf")
    for _ in range(WINDOWS):
        count, t0 = 0, time.perf_counter()
        while True:
            fn()
            count += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / WINDOWS:
                break
        best = min(best, elapsed / count)
    return best


def _counted(fn, count: int) -> float:
    """Seconds per call of ``fn`` over ``count`` calls (after one warm-up call)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - t0) / count


def measure_matmul(dtype: torch.dtype, seconds: float = 0.15) -> list[tuple[float, float]]:
    """(FLOPs of one matmul, TFLOP/s achieved) at each of :data:`MATMUL_SIZES`, up to the
    first size whose one call takes longer than ``seconds`` (an emulated dtype: fp16 on
    most CPUs is 50x slower than fp32, and its larger sizes would take seconds each)."""
    points = []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        per_call = _timed(lambda: torch.mm(a, b), seconds)
        points.append((2.0 * n**3, 2.0 * n**3 / per_call / 1e12))
        if per_call > seconds:
            break
    return points


LINEAR_WIDTHS = (64, 128, 256, 512)
"""Widths of the linear layers (width x width weight) whose matmuls are measured per layout,
each over :data:`LINEAR_TOKENS_PER_WIDTH` x width tokens (a step's batch x sequence is many
times its width): 2 x 8w x w x w FLOPs, the FLOPs of the square sizes 2w."""
LINEAR_TOKENS_PER_WIDTH = 8
OPERAND_POOL_BYTES = 64 * 2**20
"""Bytes the measured matmuls' operands are drawn from in turn: more than a CPU's last-level
cache (32 MiB on the machines this was written on), so that each call reads its operands
from memory, as a step's matmuls read activations saved long before and weights read once."""


def _layout_operands(
    layout: str, tokens: int, width: int, pool: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) pairs of a linear layer's matmul in ``layout``, views into ``pool`` that do not
    overlap: ``nt`` the forward (x @ W^T), ``nn`` the input's gradient (g @ W), ``tn`` the
    weight's gradient (g^T @ x, whose inner dimension is the tokens)."""
    activation, weight = tokens * width, width * width
    per_pair = activation + (weight if layout != "tn" else activation)
    pairs = []
    for start in range(0, pool.numel() - per_pair + 1, per_pair):
        first = pool[start : start + activation].view(tokens, width)
        second = pool[start + activation : start + per_pair]
        if layout == "nt":
            pairs.append((first, second.view(width, width).t()))
        elif layout == "nn":
            pairs.append((first, second.view(width, width)))
        else:
            pairs.append((first.t(), second.view(tokens, width)))
    return pairs


def measure_matmul_layouts(dtype: torch.dtype, seconds: float = 0.05) -> dict[str, list[tuple[float, float]]]:
    """Per layout (``nt``, ``nn``, ``tn``: see :func:`_layout_operands`), (FLOPs of one matmul,
    TFLOP/s achieved) of a linear layer's matmuls at each of :data:`LINEAR_WIDTHS`, each call
    on the next operands of a pool larger than the cache (:data:`OPERAND_POOL_BYTES`).

    A step's matmuls are not the square, cache-hot ones :func:`measure_matmul` times: they are
    tall (tokens x width), one of their operands is read transposed, a weight's gradient sums
    over the tokens, and their operands come from memory. On a 2-core CPU these ran 5-20%
    slower than a square matmul of the same FLOPs (the weight's gradient in bf16 the most).
    Stops after the first width whose one call takes longer than ``seconds``."""
    pool = torch.randn(OPERAND_POOL_BYTES // torch.empty((), dtype=dtype).element_size()).to(dtype)
    curves: dict[str, list[tuple[float, float]]] = {}
    for layout in ("nt", "nn", "tn"):
        points = curves.setdefault(layout, [])
        for width in LINEAR_WIDTHS:
            tokens = LINEAR_TOKENS_PER_WIDTH * width
            pairs = itertools.cycle(_layout_operands(layout, tokens, width, pool))
            per_call = _timed(lambda: torch.mm(*next(pairs)), seconds)
            flops = 2.0 * tokens * width * width
            points.append((flops, flops / per_call / 1e12))
            if per_call > seconds:
                break
    return curves


def measure_bandwidth(seconds: float = 0.2, nbytes: int = COPY_BYTES) -> float:
    """GB/s of a copy of ``nbytes`` (read + write)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), seconds) / 1e9


def measure_in_place(seconds: float = 0.2, nbytes: int = COPY_BYTES) -> float:
    """GB/s of an in-place update of ``nbytes`` by another tensor (``a.add_(b)``: two tensors
    read, one written, counted so), the kind of op most of an optimizer's step is."""
    a, b = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    return 3 * nbytes / _timed(lambda: a.add_(b), seconds) / 1e9


FRESH_BYTES = 64 * 2**20
"""The block :func:`measure_fresh_page_s` maps: 16,384 pages of 4 KiB."""


def _fresh_fill() -> None:
    """Map :data:`FRESH_BYTES` anew (anonymous: new pages, whatever malloc's rule in this
    process, which may serve even a large block from a heap it never trims), fill it, unmap it:
    what a block glibc maps costs a step."""
    block = mmap.mmap(-1, FRESH_BYTES)
    values = torch.frombuffer(block, dtype=torch.float32)
    values.fill_(1.0)
    del values  # the buffer is exported while the tensor lives
    block.close()


def measure_fresh_page_s(seconds: float = 0.3) -> float:
    """Seconds a new page costs when first written: a :data:`FRESH_BYTES` block mapped, filled
    and unmapped (:func:`_fresh_fill`), less the same fill of a resident tensor, per page
    (``mmap.PAGESIZE``)."""
    warm = torch.empty(FRESH_BYTES // 4)
    fresh = _timed(_fresh_fill, seconds)
    resident = _timed(lambda: warm.fill_(1.0), seconds / 3)
    return max(0.0, fresh - resident) / (FRESH_BYTES // mmap.PAGESIZE)


def measure_op_overhead(seconds: float = 0.1) -> float:
    """Seconds of one elementwise op on one element: what every op costs at least."""
    x = torch.ones(1)
    return _timed(lambda: torch.add(x, x), seconds)


class _OpCount(TorchDispatchMode):
    """Counts the ops the time model counts (:func:`timed_op`) while it is entered."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += timed_op(func)
        return func(*args, **(kwargs or {}))


def _tiny_model(device: str, sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """The tiny model every op of whose step is host cost (8 Linear(32, 32) + GELU), its Adam
    as torch picks it on ``device``, and an input; ``sharded``: each Linear and the root under
    FSDP2's ``fully_shard`` (needs the process group it shards over)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(32, 32), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    if sharded:
        from torch.distributed.fsdp import fully_shard  # lazy: only the sharded figure needs FSDP2

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters()), torch.randn(8, 32, device=device)


def _per_op(fn, device: str, seconds: float) -> float:
    """``fn``'s seconds over the ops it runs (counted once, timed in windows)."""
    counter = _OpCount()
    with counter:
        fn()
    per_call = _timed_cuda(fn, seconds) if device == "cuda" else _timed(fn, seconds)
    return per_call / max(counter.count, 1)


def measure_step_op_overhead(device: str, dtype: str, seconds: float = 0.3, sharded: bool = False) -> float:
    """Seconds per op of a tiny model's forward and backward on ``device`` in ``dtype`` (see
    the module docstring), gradients freed after each; the optimizer's step is measured apart
    (:func:`measure_optimizer_op_overhead`): its ops, outside autograd, cost the host a
    fraction of these. ``sharded``: under FSDP2 (:func:`measure_sharded_step_op_overhead`
    makes the process group)."""
    model, optimizer, x = _tiny_model(device, sharded)
    autocast = None if dtype == "fp32" else DTYPES[dtype]

    def forward_backward():
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()
    return _per_op(forward_backward, device, seconds)


def measure_optimizer_op_overhead(device: str, seconds: float = 0.3, sharded: bool = False) -> float:
    """Seconds per op of the tiny model's Adam step alone (fp32; its gradients left in place
    and stepped again each time), as :func:`measure_step_op_overhead` measures the rest."""
    model, optimizer, x = _tiny_model(device, sharded)
    model(x).square().mean().backward()
    optimizer.step()  # the state made: later steps are steady
    return _per_op(optimizer.step, device, seconds)


def _sharded_rank(rank: int, path: str, out: str, device: str, threads: int, dtypes: tuple[str, ...]) -> None:
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=1)
    try:
        figures: dict = {name: measure_step_op_overhead(device, name, sharded=True) for name in dtypes}
        try:
            figures["optimizer"] = measure_optimizer_op_overhead(device, sharded=True)
        except Exception as exc:  # noqa: BLE001 -- the step's figures stand without it (the plain optimizer's is used)
            _log.warning("the host's cost per op of an FSDP2 optimizer step was not measured (%s: %s)",
                         type(exc).__name__, exc)  # fmt: skip
        _write_figures(out, figures)
    finally:
        dist.destroy_process_group()


def measure_sharded_step_op_overhead(device: str, threads: int, dtypes: tuple[str, ...]) -> dict:
    """:func:`measure_step_op_overhead` of the tiny model under FSDP2 per dtype, and
    :func:`measure_optimizer_op_overhead`'s under key ``"optimizer"`` (where it could be), in a spawned
    process that is a world of one (a process group of its own: the caller's, a rank's, is
    left alone). FSDP2's work per step at one rank is all host work: its collectives over
    one rank move nothing. ``{}`` with the reason logged where it cannot be measured (the
    plain figure then stands for it)."""
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "sharded.json")
            args = (os.path.join(folder, "store"), out, device, threads, dtypes)
            return _in_children(_sharded_rank, args, 1, out, "the host's cost per op of an FSDP2 step")
    except Exception as exc:  # noqa: BLE001 -- measuring never breaks a run: the plain figure stands
        _log.warning("the host's cost per op of an FSDP2 step was not measured (%s: %s); the plain step's is used",
                     type(exc).__name__, exc)  # fmt: skip
        return {}


def _sharded_figures(device: str, threads: int, dtypes: tuple[str, ...]) -> dict:
    """The FSDP2 step's host costs per op as the cache holds them: the forward and backward's
    per dtype, and the optimizer's (None where not measured)."""
    found = measure_sharded_step_op_overhead(device, threads, dtypes)
    optimizer = found.pop("optimizer", None)
    return {"sharded_step_op_overhead_s": found, "sharded_optimizer_op_overhead_s": optimizer}


ATTENTION_SHAPES = ((32, 64), (16, 128), (8, 256), (4, 512), (2, 1024))
"""(batch x heads, sequence length) of the attention measured, head dimension
:data:`ATTENTION_HEAD_DIM`, causal: from a short sequence with many heads to a long one."""
ATTENTION_HEAD_DIM = 64


def measure_attention(dtype: torch.dtype, device: str = "cpu", seconds: float = 0.15) -> list[tuple[float, float]]:
    """(FLOPs, TFLOP/s) of causal ``scaled_dot_product_attention``'s forward and backward
    together at each of :data:`ATTENTION_SHAPES`, the FLOPs as torch's FLOP counter counts
    them (the op trace's rule: the whole square, though a causal kernel skips half). A
    fused attention kernel is not a matmul: on a CPU it reaches a small part of the matmul
    rate. Stops at the first shape whose one call takes longer than ``seconds``."""
    count_cpu_attention()
    points = []
    for batch_heads, seq in ATTENTION_SHAPES:
        q, k, v = (
            torch.randn(1, batch_heads, seq, ATTENTION_HEAD_DIM, device=device).to(dtype).requires_grad_()
            for _ in range(3)
        )
        grad = torch.ones(1, batch_heads, seq, ATTENTION_HEAD_DIM, device=device, dtype=dtype)

        def step():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
            q.grad = k.grad = v.grad = None

        counter = FlopCounterMode(display=False)
        with counter:
            step()
        per_call = _timed_cuda(step, seconds) if device == "cuda" else _timed(step, seconds)
        points.append((float(counter.get_total_flops()), counter.get_total_flops() / per_call / 1e12))
        if per_call > seconds:
            break
    return sorted(points)


ELEMENTWISE_ELEMENTS = 2**20
"""Elements of the tensor each elementwise op is measured on: 4 MiB in fp32, a small model's
activation, large enough that one call's dispatch is a small part of it."""
ELEMENTWISE_ROW = 512
"""The length of the rows a softmax or a layer norm reduces over in that measurement."""


def _elementwise_calls(dtype: torch.dtype) -> tuple[Callable[[], object], ...]:
    """One call of each op :func:`measure_elementwise` measures.

    Each is a pointwise or per-row op whose arithmetic, on a CPU, can outweigh its memory
    traffic: activations (GELU: an erf per element; SiLU, sigmoid, tanh: an exp; the cube in
    GPT-2's tanh GELU), exp, softmax and log-softmax, layer norm, each forward and backward
    as autograd calls it."""
    aten, row = torch.ops.aten, ELEMENTWISE_ROW
    torch.manual_seed(0)
    x = torch.randn(ELEMENTWISE_ELEMENTS // row, row).to(dtype)
    grad = torch.randn_like(x)
    weight, bias = torch.ones(row, dtype=dtype), torch.zeros(row, dtype=dtype)
    tanh, sigmoid = aten.tanh(x), aten.sigmoid(x)
    softmax, log_softmax = aten._softmax(x, -1, False), aten._log_softmax(x, -1, False)
    _, mean, rstd = aten.native_layer_norm(x, [row], weight, bias, 1e-5)
    return (
        lambda: aten.gelu(x),
        lambda: aten.gelu_backward(grad, x),
        lambda: aten.silu(x),
        lambda: aten.silu_backward(grad, x),
        lambda: aten.sigmoid(x),
        lambda: aten.sigmoid_backward(grad, sigmoid),
        lambda: aten.tanh(x),
        lambda: aten.tanh_backward(grad, tanh),
        lambda: aten.pow(x, 3.0),
        lambda: aten.exp(x),
        lambda: aten._softmax(x, -1, False),
        lambda: aten._softmax_backward_data(grad, softmax, -1, dtype),
        lambda: aten._log_softmax(x, -1, False),
        lambda: aten._log_softmax_backward_data(grad, log_softmax, -1, dtype),
        lambda: aten.native_layer_norm(x, [row], weight, bias, 1e-5),
        lambda: aten.native_layer_norm_backward(grad, x, [row], mean, rstd, weight, bias, [True, True, True]),
    )


class _OpBytes(TorchDispatchMode):
    """Each dispatched op's aten name and the bytes it reads and writes, counted as the op
    trace counts them (:func:`tensor_bytes`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((base_name(str(func)), tensor_bytes((args, kwargs)) + tensor_bytes(out)))
        return out


def measure_elementwise(dtype: torch.dtype, seconds: float = 0.03) -> dict[str, float]:
    """GB/s each op of :func:`_elementwise_calls` reaches on this CPU, keyed by its aten name
    without namespace and overload (``gelu_backward``), its bytes counted as the op trace
    counts them (inputs plus outputs), so that a traced op's bytes over this rate is its time."""
    rates = {}
    for call in _elementwise_calls(dtype):
        counter = _OpBytes()
        with counter:
            call()
        ((name, nbytes),) = counter.ops
        rates[name] = nbytes / _timed(call, seconds) / 1e9
    return rates


def _all_reduce_rank(rank: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    large = torch.ones(ALL_REDUCE_BYTES // 4)
    # a fixed number of calls on both ranks (a time limit would let them disagree on it)
    pair = calls_s(dist.group.WORLD, LATENCY_ELEMENTS, 20)  # both ranks, each kind in turn
    latency = pair["all_reduce"]  # the bandwidth's latency is the one its price adds back
    per_call = min(_counted(lambda: dist.all_reduce(large), 2) for _ in range(WINDOWS))
    alone = [dist.new_group([r]) for r in range(2)]  # every rank makes every group, in one order
    if rank == 0:
        solo = solo_call_s(alone[0])
        figures = {"latency_s": latency, "per_call_s": per_call, "pair_call_s": pair, "solo_call_s": solo}
        _write_figures(out, figures)
    dist.barrier()
    dist.destroy_process_group()


def solo_call_s(group) -> dict[str, float]:
    """Seconds one collective of each kind takes in ``group``, a group of this rank alone:
    nothing moves, so what is left is the call (torch's Python, the backend's work object, its
    wait), which a strategy pays per call at world size 1 (ZeroRedundancyOptimizer broadcasts
    each parameter, ShardedDDP reduces each gradient, FSDP2 gathers each unit)."""
    return calls_s(group, 1, 50)


def calls_s(group, elements: int, count: int) -> dict[str, float]:
    """Seconds one collective of each kind takes in ``group`` (every rank of it calls this),
    ``elements`` floats as nccl-tests counts a size (an all-reduce's, broadcast's or reduce's
    buffer, an all-gather's output, a reduce-scatter's input), ``count`` calls a window, the
    fastest of :data:`WINDOWS`. A broadcast's and a reduce's root is each rank in turn, call
    by call, as ZeRO-1's and ShardedDDP's owners are (a root alone only sends, or only
    receives: its calls would pipeline)."""
    size = dist.get_world_size(group)
    roots = itertools.cycle([dist.get_global_rank(group, r) for r in range(size)])
    whole, part = torch.ones(elements), torch.ones(max(1, elements // size))
    calls = {
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "broadcast": lambda: dist.broadcast(whole, next(roots), group=group),
        "reduce": lambda: dist.reduce(whole, next(roots), group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames the last two (..._single)
        return {kind: min(_counted(call, count) for _ in range(WINDOWS)) for kind, call in calls.items()}


def measure_local_link() -> dict[str, float]:
    """Two gloo processes on this machine: a small all-reduce's time (its latency, of
    :data:`LATENCY_ELEMENTS` floats) and a large one's bandwidth, as nccl-tests' bus bandwidth
    (2 (n-1)/n S / t, n = 2); each kind of collective's call of that small size between the
    two (:func:`calls_s`: gloo's kinds are different algorithms, a broadcast one message one
    way, an all-reduce two exchanges both ways); and each kind's call in a group of one rank
    (:func:`solo_call_s`)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "link.json")
        found = _in_children(_all_reduce_rank, (os.path.join(folder, "store"), out), 2, out, "the local gloo link")
    bus = ALL_REDUCE_BYTES / max(found["per_call_s"] - found["latency_s"], 1e-9)
    # a 2-rank ring all-reduce is 2 steps: each pays half the small collective's time
    return {
        "bandwidth_GBps": bus / 1e9,
        "step_latency_us": found["latency_s"] / 2 * 1e6,
        "pair_call_us": {kind: s * 1e6 for kind, s in found["pair_call_s"].items()},
        "solo_call_us": {kind: s * 1e6 for kind, s in found["solo_call_s"].items()},
    }


CPU_STEP_DTYPES = ("fp32", "bf16")
"""The dtypes a CPU run computes in (autocast on CPU takes bf16; precision 16 is a GPU's)."""
GPU_MATMUL_SIZES = (256, 1024, 2048, 4096, 8192)
GPU_COPY_BYTES = 2**30


def _timed_cuda(fn, seconds: float) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream: the fastest of :data:`WINDOWS`
    windows sharing about ``seconds``, calls in batches of 10, each batch waited for (a GPU
    runs them asynchronously)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(WINDOWS):
        count, t0 = 0, time.perf_counter()
        while True:
            for _ in range(10):
                fn()
            count += 10
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / WINDOWS:
                break
        best = min(best, elapsed / count)
    return best


def measure_cuda() -> dict:
    """Every figure of the CUDA device's ``this`` profile, measured in this process."""
    matmul = {}
    for name, dtype in DTYPES.items():
        points = []
        for n in GPU_MATMUL_SIZES:
            a, b = (torch.randn(n, n, device="cuda").to(dtype) for _ in range(2))
            points.append((2.0 * n**3, 2.0 * n**3 / _timed_cuda(lambda: torch.mm(a, b), 0.1) / 1e12))
        matmul[name] = points
    src = torch.ones(GPU_COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * GPU_COPY_BYTES / _timed_cuda(lambda: dst.copy_(src), 0.2) / 1e9
    x = torch.ones(1, device="cuda")
    return {
        "matmul": matmul,
        "memory_bandwidth_GBps": bandwidth,
        "host": measure_host_side(),
        "op_overhead_s": _timed_cuda(lambda: torch.add(x, x), 0.1),
        "step_op_overhead_s": {name: measure_step_op_overhead("cuda", name) for name in DTYPES},
        "optimizer_op_overhead_s": measure_optimizer_op_overhead("cuda"),
        "attention": _cuda_attention(),
        **_sharded_figures("cuda", 1, tuple(DTYPES)),
        "device_name": torch.cuda.get_device_name(0),
        "memory_GB": torch.cuda.get_device_properties(0).total_memory / 1e9,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


HOST_COPY_BYTES = 256 * 2**20
"""The pinned host buffer :func:`measure_host_side` copies to and from the GPU."""
HOST_MEMORY_COPY_BYTES = 2**30
"""The copy :func:`measure_host_side` times the host's memory with: larger than a server CPU's
last-level cache, as an offloaded shard's optimizer state is (a copy that fits the cache
measures the cache: on this project's 2-core VM, whose L3 is 300 MiB, a 64 MiB copy read 20.8
GB/s at one thread and a 1 GiB copy 11.5 to 13.8 on 2026-12-06)."""


def _pinned_copies() -> tuple[float, float]:
    """GB/s of a pinned host buffer's copy to the GPU and back (:data:`HOST_COPY_BYTES`)."""
    host = torch.ones(HOST_COPY_BYTES // 4, pin_memory=True)
    device = torch.empty(HOST_COPY_BYTES // 4, device="cuda")
    h2d = HOST_COPY_BYTES / _timed_cuda(lambda: device.copy_(host, non_blocking=True), 0.1) / 1e9
    d2h = HOST_COPY_BYTES / _timed_cuda(lambda: host.copy_(device, non_blocking=True), 0.1) / 1e9
    return h2d, d2h


def measure_host_side() -> dict:
    """What CPU offload runs at on this machine: the host's memory (a copy of
    :data:`HOST_MEMORY_COPY_BYTES`, and an in-place update of as much, :func:`measure_in_place`,
    on the CPU at every core this process may run on, whatever threads the launcher set: the
    server's whole figures, which the node's ranks share; and a new page's cost,
    :func:`measure_fresh_page_s`) and a pinned host buffer's copies to and from the GPU (GB/s
    each way). Each part that cannot be measured is left out, with the
    reason logged (offload is then not priced)."""
    found: dict = {}
    before = torch.get_num_threads()
    try:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(threads)
        found |= {"memory_bandwidth_GBps": measure_bandwidth(0.5, HOST_MEMORY_COPY_BYTES),
                  "in_place_GBps": measure_in_place(0.5, HOST_MEMORY_COPY_BYTES), "threads": threads,
                  "fresh_page_s": measure_fresh_page_s()}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 -- measuring never breaks a run
        _log.warning("the host's memory was not measured (%s: %s); CPU offload is not priced", type(exc).__name__, exc)
    finally:
        torch.set_num_threads(before)
    try:
        found["h2d_GBps"], found["d2h_GBps"] = _pinned_copies()
    except Exception as exc:  # noqa: BLE001 -- e.g. pinned memory refused (ulimit -l)
        _log.warning("the GPU's copies to and from the host were not measured (%s: %s); CPU offload is not priced",
                     type(exc).__name__, exc)  # fmt: skip
    return found


def _cuda_attention() -> dict:
    """The GPU's attention curves per dtype (:func:`measure_attention`); ``{}`` with the reason
    logged where it cannot be measured (attention is then priced at the matmul's curve)."""
    try:
        return {name: measure_attention(dtype, "cuda", 0.1) for name, dtype in DTYPES.items()}
    except Exception as exc:  # noqa: BLE001 -- measuring never breaks a run
        _log.warning("attention was not measured on the GPU (%s: %s); it is priced at the matmul's curve",
                     type(exc).__name__, exc)  # fmt: skip
        return {}


def _cuda_child(rank: int, out: str) -> None:
    _write_figures(out, measure_cuda())


def measure_cuda_in_child() -> dict:
    """:func:`measure_cuda` in a spawned process: the caller's CUDA stays uninitialised."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "cuda.json")
        return _in_children(_cuda_child, (out,), 1, out, "the CUDA device's figures")


ATTEMPTS = 2
"""How many times a disturbed CPU profile is measured (see the module docstring): a second try
outlasts a passing blip (another process's start); a machine that stays busy is not waited
for (each try takes the profile's whole time again)."""


def cpu_elsewhere_s(stat: str | None = None) -> float | None:
    """CPU seconds the machine has spent so far outside this process and the children it
    waited for: busy time in ``/proc/stat`` (user, nice, system, irq, softirq, and steal,
    which a VM's neighbours take) less this process's and its reaped children's
    (``getrusage``). Read twice, the difference is what other processes took in between.
    None where there is no ``/proc/stat`` (not Linux)."""
    import resource  # lazy: Unix only (/proc/stat is read on Linux only)

    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.readline()
        except OSError:
            return None
    fields = stat.split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))  # fmt: skip
    return busy - own


def disturbed(elsewhere_cores: float | None, threads: int, cpus: int | None = None) -> bool:
    """Whether other processes, using ``elsewhere_cores`` cores on average while a profile at
    ``threads`` threads was measured, took cores the measurement needed: more than the cores
    it left idle, and half a core: a quiet 2-core VM counted 0.07-0.19 cores elsewhere, the
    profile's own helper processes among them, where a test suite beside it took 0.79)."""
    if elsewhere_cores is None:
        return False
    cpus = cpus or os.cpu_count() or 1
    return elsewhere_cores > max(0, cpus - threads) + 0.5


def measure(threads: int) -> dict:
    """Every figure of the ``this`` profile, with ``threads`` torch threads; also
    ``elsewhere_cores``, the cores other processes used on average meanwhile (None: not known)."""
    start, wall = cpu_elsewhere_s(), time.perf_counter()
    figures = _measure(threads)
    end = cpu_elsewhere_s()
    known = start is not None and end is not None
    figures["elsewhere_cores"] = max(0.0, end - start) / (time.perf_counter() - wall) if known else None
    return figures


def _measure(threads: int) -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        figures = {
            "matmul": {name: measure_matmul(dtype) for name, dtype in DTYPES.items()},
            "memory_bandwidth_GBps": measure_bandwidth(),
            "op_overhead_s": measure_op_overhead(),
            "attention": {name: measure_attention(DTYPES[name]) for name in CPU_STEP_DTYPES},
            "elementwise_GBps": {name: measure_elementwise(DTYPES[name]) for name in CPU_STEP_DTYPES},
            "matmul_layouts": {name: measure_matmul_layouts(DTYPES[name]) for name in CPU_STEP_DTYPES},
            "step_op_overhead_s": {name: measure_step_op_overhead("cpu", name) for name in CPU_STEP_DTYPES},
            "optimizer_op_overhead_s": measure_optimizer_op_overhead("cpu"),
            "fresh_page_s": measure_fresh_page_s(),
        }
    finally:
        torch.set_num_threads(before)
    figures |= _sharded_figures("cpu", threads, CPU_STEP_DTYPES)
    figures["link"] = measure_local_link()
    return figures


FIGURES_VERSION = 9
"""Bumped when the figures measured change (2: the step's host cost per op; 3: the fastest of
several windows; 4: attention's own curve, the host's cost per op of an FSDP2 step; 5: the
elementwise ops' own rates, a linear layer's matmuls per layout; 6: a new page's cost on CPU;
7: a collective's call in a group of one rank; 8: the optimizer's step per op apart from the
forward and backward's; 9: the link's latency from a 1 KiB all-reduce, not one float's, and
each kind's 1 KiB call between the two ranks):
older entries are measured again."""


CUDA_FIGURES_VERSION = 8
"""The GPU's figures' version (7: the host's side, :func:`measure_host_side`; 8: the
optimizer's step per op apart); the CPU's stay at :data:`FIGURES_VERSION`."""


def _key(threads: int, device: str = "cpu") -> str:
    where = "cuda" if device == "cuda" else f"cpu|threads={threads}"
    version = CUDA_FIGURES_VERSION if device == "cuda" else FIGURES_VERSION
    return f"{socket.gethostname()}|torch {torch.__version__}|{where}|v{version}"


def this_figures(threads: int, remeasure: bool = False, device: str = "cpu") -> dict:
    """The cached figures of this machine (its CPU at ``threads`` threads, or its GPU),
    measured when absent."""
    path, key = cache_path(), _key(threads, device)
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    if remeasure or key not in cache:
        found = measure_cuda_in_child() if device == "cuda" else _least_disturbed(threads)
        cache[key] = found | {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        save_cache(path, cache)
    return cache[key]


def _least_disturbed(threads: int) -> dict:
    """The CPU profile measured until undisturbed (:func:`disturbed`), at most :data:`ATTEMPTS`
    times; the least disturbed measurement, with a warning if even that one was."""
    tries = []
    for _ in range(ATTEMPTS):
        tries.append(measure(threads))
        if not disturbed(tries[-1].get("elsewhere_cores"), threads):
            return tries[-1]
    best = min(tries, key=lambda f: f["elsewhere_cores"])
    _log.warning(
        "the this profile (%d thread(s)) was measured while other processes used %.2f cores on average "
        "(%d tries): its figures may be slow, and step times predicted long, until it is measured again on a "
        "quieter machine (delete %s: the next run or plan measures it anew)",
        threads, best["elsewhere_cores"], len(tries), cache_path(),
    )  # fmt: skip
    return best


def this_cuda_profile(remeasure: bool = False) -> DeviceProfile:
    """The ``this`` profile of the CUDA device (see the module docstring)."""
    found = this_figures(1, remeasure, "cuda")
    name = found["device_name"]
    source = Source("measured", f"measured on {name} at {found.get('measured_at', '?')}", cache_path())
    curves = {("matmul", d): Curve(tuple(tuple(p) for p in pts), source) for d, pts in found["matmul"].items()}
    curves |= {("attention", d): c for (k, d), c in list(curves.items())}
    curves |= {
        ("attention", d): Curve(tuple(tuple(p) for p in pts), source, causal_calls=True)
        for d, pts in found.get("attention", {}).items()
    }
    peaks = {}
    for dtype, points in found["matmul"].items():
        table, why = gpu_peak(name, {"fp32": "32", "fp16": "16", "bf16": "bf16"}[dtype])
        best = max(t for _, t in points)
        peaks[dtype] = (
            Figure(table / 1e12, Source("datasheet", why, "sharded_exp.measure.flops.GPU_PEAKS"))
            if table
            else Figure(best, source, f"the best measured size ({why})")
        )
    host = found.get("host") or {}
    host_memory = None
    if host.get("memory_bandwidth_GBps") and host.get("in_place_GBps"):
        at = f"1 GiB on the host at {host.get('threads', '?')} threads"
        host_memory = HostMemory(copy=Figure(host["memory_bandwidth_GBps"], source, f"a copy of {at}"),
                                 in_place=Figure(host["in_place_GBps"], source, f"an in-place add of {at}"),
                                 fresh_page_s=host.get("fresh_page_s"))  # fmt: skip
    return DeviceProfile(
        name="this",
        title=f"this machine ({name})",
        memory=Figure(found["memory_GB"], source),
        memory_bandwidth=Figure(found["memory_bandwidth_GBps"], source),
        peak_tflops=peaks,
        curves=curves,
        op_overhead_s=found["op_overhead_s"],
        step_op_overhead_s=found["step_op_overhead_s"],
        sharded_step_op_overhead_s=found.get("sharded_step_op_overhead_s", {}),
        optimizer_op_overhead_s=found.get("optimizer_op_overhead_s"),
        sharded_optimizer_op_overhead_s=found.get("sharded_optimizer_op_overhead_s"),
        asynchronous=True,
        host_memory=host_memory,
    )


def this_cuda_host_link(remeasure: bool = False) -> LinkProfile | None:
    """The GPU's link to the host as measured (:func:`measure_host_side`): a pinned buffer's
    copies, the slower direction (CPU offload's schedule prices both at one rate); None where
    it was not measured."""
    found = this_figures(1, remeasure, "cuda")
    host = found.get("host") or {}
    if not host.get("h2d_GBps") or not host.get("d2h_GBps"):
        return None
    source = Source("measured", f"measured on {found['device_name']} at {found.get('measured_at', '?')}", cache_path())
    rate = Figure(min(host["h2d_GBps"], host["d2h_GBps"]), source, "a pinned buffer's copy, the slower direction")
    zero = Figure(0.0, source, "not measured: a copy pays no collective's steps")
    return LinkProfile(name="this_host", title="this GPU's link to the host", link_class="pcie", bandwidth=rate,
                       ring_step_latency=zero, tree_step_latency=zero)  # fmt: skip


def this_profile(threads: int, remeasure: bool = False) -> tuple[DeviceProfile, LinkProfile]:
    """The ``this`` device and its local link (see the module docstring)."""
    found = this_figures(threads, remeasure)
    when = found.get("measured_at", "?")
    busy = found.get("elsewhere_cores")
    elsewhere = f", other processes using {busy:.2f} cores meanwhile" if disturbed(busy, threads) else ""
    source = Source(
        "measured", f"measured on {socket.gethostname()} at {when}, {threads} thread(s){elsewhere}", cache_path()
    )
    curves = {("matmul", d): Curve(tuple(tuple(p) for p in pts), source) for d, pts in found["matmul"].items()}
    # attention at its own measured rate; a dtype it was not measured in at the matmul's
    curves |= {("attention", d): c for (k, d), c in list(curves.items())}
    curves |= {
        ("attention", d): Curve(tuple(tuple(p) for p in pts), source, causal_calls=True)
        for d, pts in found.get("attention", {}).items()
    }
    layouts = {
        (layout, d): Curve(tuple(tuple(p) for p in pts), source)
        for d, per_layout in found.get("matmul_layouts", {}).items()
        for layout, pts in per_layout.items()
    }
    elementwise = {
        (op, d): rate * 1e9 for d, ops in found.get("elementwise_GBps", {}).items() for op, rate in ops.items()
    }
    # MFU's denominator: fp32 only, as a run's mfu_pct (sharded_exp.measure.flops.device_peak:
    # autocast on a CPU runs kernels a measured bf16 or fp16 matmul does not)
    peaks = {d: Figure(max(t for _, t in pts), source, "the best measured size")
             for d, pts in found["matmul"].items() if d == "fp32"}  # fmt: skip
    device = DeviceProfile(
        name="this",
        title=f"this machine (CPU, {threads} thread(s))",
        memory=Figure(0.0, source, "not measured"),
        memory_bandwidth=Figure(found["memory_bandwidth_GBps"], source),
        peak_tflops=peaks,
        curves=curves,
        op_overhead_s=found["op_overhead_s"],
        step_op_overhead_s=found["step_op_overhead_s"],
        sharded_step_op_overhead_s=found.get("sharded_step_op_overhead_s", {}),
        optimizer_op_overhead_s=found.get("optimizer_op_overhead_s"),
        sharded_optimizer_op_overhead_s=found.get("sharded_optimizer_op_overhead_s"),
        elementwise_Bps=elementwise,
        layout_curves=layouts,
        fresh_page_s=found.get("fresh_page_s"),
    )
    link = found["link"]
    local = LinkProfile(
        name="this_local",
        title="this machine's local gloo link",
        link_class="pcie",
        bandwidth=Figure(link["bandwidth_GBps"], source),
        ring_step_latency=Figure(link["step_latency_us"], source),
        tree_step_latency=Figure(link["step_latency_us"], source),
        reduce_scatter_as_all_reduce=True,  # gloo's
        pair_call_s={kind: us * 1e-6 for kind, us in link.get("pair_call_us", {}).items()},
        solo_call_s={kind: us * 1e-6 for kind, us in link.get("solo_call_us", {}).items()},
    )
    return device, local
