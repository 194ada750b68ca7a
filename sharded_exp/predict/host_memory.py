"""Host memory under CPU offload, as the host holds it.

FSDP2's CPU offload (``CPUOffloadPolicy(pin_memory=True)``, ``strategies/fsdp.py``) keeps each
rank's sharded parameters, gradients and optimizer state in host memory, and steps the
optimizer there. The parameters and gradients are *pinned*: page-locked blocks handed out by
torch's CachingHostAllocator, whose sizes are not the tensors' bytes. Read in torch's
``ATen/core/CachingHostAllocator.h`` (``CachingHostAllocatorImpl::allocate``, as installed with
torch 2.11 and 2.13) and FSDP2's ``_fsdp_param.py`` and ``_fsdp_collectives.py`` (torch 2.13):

- **A pinned request is rounded up to the next power of two** (``c10::llvm::PowerOf2Ceil``,
  "to improve reuse"), and the block is held whole. torch 2.13 rounds only requests up to
  ``pinned_max_round_threshold_mb`` and ``pinned_max_cached_size_mb`` of
  ``PYTORCH_CUDA_ALLOC_CONF`` (both unlimited by default); torch 2.11 always rounds.
- **Each parameter's shard is pinned on its own**: ``FSDPParam`` pads the shard to equal dim-0
  chunks, copies it to the CPU and calls ``pin_memory()`` on it, once, when the model is sharded.
- **Each gradient shard is pinned on its own, unpadded**: after the reduce-scatter, the rank's
  own rows of the padded output are copied out with ``.to("cpu", non_blocking=True)``, which
  allocates a pinned tensor. Freed by ``zero_grad``, a pinned block goes back to the
  allocator's cache, not to the system: the host keeps it from step to step.
- **The optimizer's state is ordinary (pageable) memory**, at its bytes: the optimizer makes
  it on the CPU with ``zeros_like``.
- **The host's optimizer step** makes temporaries: the bytes per element its ops write into
  new tensors, counted from the configured optimizer's own ops on a real CPU tensor
  (:func:`~sharded_exp.predict.step_time.host_step_bytes`; Adam's square root and the bias
  correction's quotient, 8 bytes). An offloaded run builds its optimizer as torch does for
  CPU tensors, per tensor (``strategies/fsdp.py``): those bytes for the rank's largest tensor.
  Under ``optimizer.foreach=true`` each op makes its new tensors for a whole parameter group
  at once: those bytes for every element of the rank's largest group (for Llama 2 70B at 8
  ranks, 32 GiB a rank).

A rank's host peak is therefore every pinned block plus the optimizer state plus the step's
temporaries, all live at the optimizer step. The figures are per rank;
a node holds those of its ranks (:func:`node_mib`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sharded_exp.predict.allocator import AllocatorSettings
from sharded_exp.predict.memory_model import optimizer_state_bytes

MIB = 2**20


def pinned_block_bytes(size: int, settings: AllocatorSettings) -> int:
    """The bytes of the pinned block a ``size``-byte request takes (see the module docstring)."""
    if size <= 0:
        return 0
    if size > settings.pinned_max_round_threshold or size > settings.pinned_max_cached_size:
        return size
    return 1 << (size - 1).bit_length()


def offload_host_mib(
    pinned_numels: Sequence[int], optimizer_numels: Sequence[int], optimizer_cfg, element: float,
    settings: AllocatorSettings, step_elements: int = 0, step_bytes_per_element: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """One rank's host memory under CPU offload, MiB: ``pinned`` (its parameter and gradient
    shards, each a block of :func:`pinned_block_bytes`), ``tensor_bytes`` (the same tensors at
    their bytes, what ``pinned`` rounds), ``optimizer`` (its state, pageable), ``step`` (the
    host step's temporaries: ``step_bytes_per_element`` for each of ``step_elements``, the
    rank's largest group, or largest tensor, that one op steps) and ``total``.

    ``pinned_numels``: the element count of each tensor the rank pins
    (:meth:`~sharded_exp.strategies.fsdp.FSDPMemory.pinned_numels`); ``optimizer_numels``: the
    tensors it keeps optimizer state for; ``element``: bytes per element.
    """
    sizes = [math.ceil(n * element) for n in pinned_numels]
    pinned = sum(pinned_block_bytes(b, settings) for b in sizes) / MIB
    optimizer = optimizer_state_bytes(optimizer_cfg, optimizer_numels, element) / MIB
    step = step_elements * step_bytes_per_element / MIB
    return {
        "pinned": pinned,
        "tensor_bytes": sum(sizes) / MIB,
        "optimizer": optimizer,
        "step": step,
        "total": pinned + optimizer + step,
    }


def node_mib(per_rank_mib: Sequence[float], ranks_on_node: int) -> float:
    """What the fullest node holds: the sum of its ranks' host figures, the largest
    ``ranks_on_node`` taken (ranks differ only where shards are uneven)."""
    return sum(sorted(per_rank_mib, reverse=True)[: max(1, ranks_on_node)])
