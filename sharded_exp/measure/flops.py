"""Model FLOPs utilisation: the fake step's FLOPs per step over the device's peak.

GPU peaks are the vendors' dense (no sparsity) figures by device name. A CPU has no
published peak for our purpose: its matmul throughput is measured on this machine, with
the threads one rank gets, and labelled as measured: the peak the run's step-time
prediction divided by (the ``this`` profile's best matmul, as the planner's MFU) where it
has one, else one 1024 x 1024 matmul, cached.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry, register_flop_formula

from sharded_exp.precision import compute_dtype

TERA = 1e12


def count_cpu_attention() -> None:
    """Give torch's FLOP counter the formulas it lacks for the CPU's fused attention
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, torch 2.13): the same
    counts as its CUDA flash kernels' (two matmuls forward, four backward). Without them a
    CPU step's attention counts no FLOPs: the time model priced it by its bytes and the
    model's FLOPs (MFU) left it out. Registered once, into torch's registry (which
    ``FlopCounterMode`` and this trace both read); a torch that has its own is left alone."""
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in flop_registry:

        @register_flop_formula(forward)
        def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)  # looked up at each call

    if backward is not None and backward not in flop_registry:

        @register_flop_formula(backward)
        def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


count_cpu_attention()

# Dense tensor-core peaks (FLOP/s); fp32 is the plain (non-TF32) figure, torch's default
# matmul precision. From NVIDIA's data sheets. The key is the model as torch names it
# (``torch.cuda.get_device_name``), matched as whole words: "H100" is the SXM part, which
# names no form factor (``NVIDIA H100 80GB HBM3``); PCIe and NVL parts say so.
GPU_PEAKS = {
    ("GH200",): {"bf16": 989 * TERA, "16": 989 * TERA, "32": 67 * TERA},
    ("H200", "NVL"): {"bf16": 835 * TERA, "16": 835 * TERA, "32": 60 * TERA},
    ("H200",): {"bf16": 989 * TERA, "16": 989 * TERA, "32": 67 * TERA},
    ("H100", "NVL"): {"bf16": 835 * TERA, "16": 835 * TERA, "32": 60 * TERA},
    ("H100", "PCIe"): {"bf16": 756 * TERA, "16": 756 * TERA, "32": 51 * TERA},
    ("H100",): {"bf16": 989 * TERA, "16": 989 * TERA, "32": 67 * TERA},
    ("A100",): {"bf16": 312 * TERA, "16": 312 * TERA, "32": 19.5 * TERA},
}


def _words(name: str) -> set[str]:
    return set(name.replace("-", " ").split())


def gpu_peak(name: str, precision_name: str) -> tuple[float | None, str]:
    """(the table's peak for a CUDA device name, where it comes from or why there is none)."""
    words = _words(name)
    if "MIG" in words:
        return None, f"{name!r} is a MIG slice: its share of the GPU's peak is not known"
    for key, peaks in GPU_PEAKS.items():  # the more specific names come first
        if (
            set(key) <= words
            and not (key == ("H200",) and "NVL" in words)
            and not (key == ("H100",) and words & {"NVL", "PCIe"})
        ):
            return peaks[str(precision_name)], f"table: {name}, dense {precision_name}"
    return None, f"unknown device {name!r}: no peak"


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sharded_exp", "cpu_matmul_peak.json")


def measure_cpu_matmul(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` on this CPU with the current torch threads."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - t0)


def cpu_peak(precision_name: str) -> float:
    """This CPU's measured matmul peak at the precision's compute dtype, cached per CPU
    model, thread count and dtype (the first call measures for about half a second)."""
    dtype = compute_dtype(precision_name) or torch.float32
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|threads={torch.get_num_threads()}|{dtype}"
    path = _cache_path()
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict) or not isinstance(cache.get(key), (int, float)):
        cache = cache if isinstance(cache, dict) else {}
        cache[key] = measure_cpu_matmul(dtype)
        save_cache(path, cache)
    return float(cache[key])


def device_peak(device: torch.device, precision_name: str, predicted: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank's device, where the figure comes from or why there is none).
    ``predicted``: on a CPU, the peak the run's step-time prediction divided by (its ``this``
    profile's), so that the run's MFU and the prediction's share one denominator."""
    precision_name = str(precision_name)
    if device.type == "cuda":
        if precision_name == "32" and torch.backends.cuda.matmul.allow_tf32:
            return None, "TF32 matmuls are on (allow_tf32): the fp32 peak does not apply"
        return gpu_peak(torch.cuda.get_device_name(device), precision_name)
    if precision_name != "32":
        # Autocast on a CPU runs kernels a measured fp16/bf16 matmul does not (often emulated
        # and slower than what the step runs): no peak to hold them to.
        return None, f"no trustworthy CPU peak at precision {precision_name}"
    threads = torch.get_num_threads()
    if predicted:  # the planner's peak, where the run's prediction had one
        return (
            predicted,
            f"measured: matmul on this CPU, {threads} thread(s) per rank, the best size of the `this` profile (the run's own step-time prediction's peak)",
        )
    return cpu_peak(precision_name), f"measured: matmul on this CPU, {threads} thread(s) per rank"


def utilisation(
    flops_per_step: int | None,
    step_time_s: float | None,
    device: torch.device,
    precision_name: str,
    predicted_peak: float | None = None,
):
    """``throughput`` fields: model FLOPs per step, achieved FLOP/s and MFU of one rank
    (``predicted_peak``: see :func:`device_peak`)."""
    if not flops_per_step or not step_time_s:
        return {"model_flops_per_step_per_rank": flops_per_step, "achieved_flops_per_s": None, "mfu_pct": None}
    achieved = flops_per_step / step_time_s
    peak, source = device_peak(device, precision_name, predicted_peak)
    mfu = achieved / peak if peak else None
    if mfu is not None and mfu > 1:  # never printed: the peak is not this device's
        source, mfu = f"{source}; achieved {achieved / TERA:.3g} TFLOP/s is above it: peak not trusted", None
    return {
        "model_flops_per_step_per_rank": flops_per_step,
        "achieved_flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_flops_source": source,  # where the peak comes from, or why mfu_pct is null
        "mfu_pct": None if mfu is None else 100 * mfu,  # in percent everywhere: result.json, W&B, tables
    }


def save_cache(path: str, cache: dict) -> None:
    """A measurement cache written whole and atomically (a temporary file, then renamed); a
    home that cannot be written leaves it uncached: measured again next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
