"""A rank's host allocator, glibc's malloc: the heap reused and never trimmed (the default), glibc's own rule, or the mmap threshold fixed at 4 MiB.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB by default) with a
mapping of its own and unmaps it on ``free``; smaller ones come from the heap, whose top is
given back to the kernel (trimmed) when more than ``M_TRIM_THRESHOLD`` of it is free. Left to
itself the mmap threshold is *dynamic* (mallopt(3)): when a mapped block is freed, the
threshold rises to that block's size (up to 32 MiB on 64-bit) and the trim threshold to twice
it. Setting either explicitly turns the adjustment off.

Each page the kernel gives a process is faulted in and zeroed when first written: a block
mapped anew, or heap given back and taken again, costs its pages every time
(:attr:`~sharded_exp.speed.profiles.DeviceProfile.fresh_page_s`, about a microsecond each).

``trainer.host_mmap_threshold`` picks one rule for every rank, whatever the strategy:

- ``reuse`` (the default): the threshold at the dynamic rule's maximum (32 MiB) and trimming
  off, so a step's blocks up to 32 MiB come from a heap that keeps its pages, and each step
  reuses the last one's: no page is faulted twice. Larger blocks are mapped anew each time,
  unless the heap's top is free and large enough to serve one; the time model prices them all
  (:func:`mapped_from`), an upper bound. This is what PyTorch's
  performance tuning guide asks of an allocator on CPU ("Switch Memory allocator": reuse
  memory as much as possible), with glibc's own malloc. The heap keeps its peak resident.
- ``dynamic``: glibc's rule, as your own script gets it. The heap's top is trimmed above
  twice the threshold and taken back the next step: a gpt small step faults in 1,000-3,100
  pages a rank this way (docs/figures.md), a count that moves from run to run with the heap's
  layout, and which the time model does not price.
- ``fixed``: the threshold fixed at 4 MiB (glibc's default trimming), so a freed block of 4
  MiB or more goes back to the kernel. A FSDP rank frees one unit's gathered parameters and
  gradients after every unit; under the other rules these are carved from the heap around
  live blocks and the rank's resident set grows by hundreds of MiB that no live tensor holds
  (docs/concepts/memory.md, "On CPU: resident memory"). ``fixed`` spares that at the price
  of new pages every step for every block of 4 MiB or more (a 1024-wide MLP's steps 26-38%
  longer, hf_gpt2's 39-101%, in docs/figures.md).

Only CPU ranks set a rule: a GPU rank's tensors are the CUDA allocator's, and its host malloc
is left as glibc has it.

A setting of glibc's for what the rules set, in the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``, or their
``glibc.malloc`` tunables in ``GLIBC_TUNABLES``), is yours: no rule touches malloc then. Others
(``MALLOC_ARENA_MAX``, ``glibc.malloc.arena_max``) do not stop a rule.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (<malloc.h>)."""

MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
"""The threshold ``fixed`` sets: blocks of 4 MiB or more are mapped, and unmapped when freed."""

DYNAMIC_THRESHOLD_MAX = 32 * 1024 * 1024
"""How high glibc's dynamic threshold rises on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX`` in
malloc.c, mallopt(3)), and the largest it can be set to: a larger block is mapped every time,
whatever the rule."""

DEFAULT_THRESHOLD_BYTES = 128 * 1024
"""glibc's mmap and trim thresholds before anything moves them (mallopt(3))."""

NEVER = -1
"""``M_TRIM_THRESHOLD`` -1: trimming off (mallopt(3))."""

RULES = {
    "reuse": (DYNAMIC_THRESHOLD_MAX, NEVER),
    "fixed": (MMAP_THRESHOLD_BYTES, DEFAULT_THRESHOLD_BYTES),
    # glibc's own: nothing is set, unless a rule was set for an earlier job in this process
    # (torchrun's ranks run a -m sweep's jobs in one process), which glibc cannot undo: then
    # the dynamic rule's steady state, the threshold at its maximum and trimming above twice it
    "dynamic": (DYNAMIC_THRESHOLD_MAX, 2 * DYNAMIC_THRESHOLD_MAX),
}
"""``trainer.host_mmap_threshold`` -> the (mmap threshold, trim threshold) a rank sets."""

YOUR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's environment variables for what the rules set (each turns the dynamic rule off)."""
YOUR_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
"""The same as ``glibc.malloc.*`` tunables (``GLIBC_TUNABLES``)."""


def _tunables(env) -> dict[str, str]:
    """``GLIBC_TUNABLES``' ``glibc.malloc.*`` settings, by the name after ``glibc.malloc.``."""
    items = env.get("GLIBC_TUNABLES", "").replace(":", " ").split()
    pairs = dict(item.split("=", 1) for item in items if "=" in item)
    return {k.removeprefix("glibc.malloc."): v for k, v in pairs.items() if k.startswith("glibc.malloc.")}


def _yours(env) -> bool:
    """Whether ``env`` sets what the rules set (then nothing here touches malloc)."""
    return any(k in env for k in YOUR_SETTINGS) or any(k in YOUR_TUNABLES for k in _tunables(env))


_set_here = False
"""Whether a rule set this process's malloc already: glibc cannot go back to its dynamic rule."""


def _mallopt(settings: tuple[int, int]) -> tuple[int, int] | None:
    """Set (mmap threshold, trim threshold); what was set, or None where the C library is
    not glibc (musl, macOS) or mallopt refused."""
    global _set_here
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library, no search for a file
        libc.gnu_get_libc_version  # only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_threshold, trim_threshold = settings
    if mallopt(M_MMAP_THRESHOLD, mmap_threshold) != 1 or mallopt(M_TRIM_THRESHOLD, trim_threshold) != 1:
        return None
    _set_here = True
    return settings


def set_malloc_rule(rule: str, env=os.environ) -> tuple[int, int] | None:
    """A rank's ``trainer.host_mmap_threshold`` (the module docstring): the (mmap threshold,
    trim threshold) set (-1: never trimmed), or None where nothing was set (your own setting
    in ``env``, glibc's rule in a process no rule touched, not glibc)."""
    if rule not in RULES:
        raise ValueError(f"trainer.host_mmap_threshold={rule!r} must be one of {', '.join(RULES)}")
    if _yours(env) or (rule == "dynamic" and not _set_here):
        return None
    return _mallopt(RULES[rule])


def mapped_from(env=os.environ, rule: str = "reuse") -> int | None:
    """The smallest block a rank's glibc maps anew each time it is asked for, in a steady
    state (bytes), under ``rule`` (``trainer.host_mmap_threshold``): 4 MiB under ``fixed``,
    else above the dynamic rule's maximum (32 MiB); your threshold where ``env`` sets one
    (``MALLOC_MMAP_THRESHOLD_``, ``glibc.malloc.mmap_threshold``), glibc's 128 KiB where it
    sets another of glibc's malloc settings that stops the threshold moving, the dynamic
    rule's maximum where it sets none of them (``MALLOC_ARENA_MAX`` does not count); none where
    it forbids mapping (``MALLOC_MMAP_MAX_=0``: ``sys.maxsize``). None where the C library is
    not glibc (not modelled).

    Each such block is new pages, which the kernel faults in (and zeroes) when they are first
    written: the time model prices them (:attr:`~sharded_exp.speed.profiles.DeviceProfile.fresh_page_s`).
    An upper bound: glibc serves such a block from a free heap chunk (or the heap's top) where
    one is big enough. Under ``dynamic`` the heap's trimmed top is faulted in again too, which
    is not counted."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    tunables = _tunables(env)
    mine = {k: env.get(f"MALLOC_{k.upper()}_", tunables.get(k)) for k in YOUR_TUNABLES}
    if mine["mmap_max"] is not None and _number(mine["mmap_max"]) == 0:
        return sys.maxsize  # no block is ever mapped
    if mine["mmap_threshold"] is not None:
        threshold = _number(mine["mmap_threshold"])
        return DYNAMIC_THRESHOLD_MAX if threshold is None else threshold  # glibc ignores what it cannot read
    if any(v is not None for v in mine.values()):
        return DEFAULT_THRESHOLD_BYTES  # the threshold no longer moves from where glibc starts it
    return MMAP_THRESHOLD_BYTES if rule == "fixed" else DYNAMIC_THRESHOLD_MAX


def _number(text: str) -> int | None:
    """A number as glibc reads one (decimal, or 0x hexadecimal, or 0 octal), None if it is not."""
    try:
        return int(text, 0)
    except ValueError:
        return None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>, glibc 2.33 and later): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def heap_free_mib() -> float | None:
    """MiB the process's malloc heaps hold free (``mallinfo2().fordblks``: free chunks and the
    top chunk, every arena), or None where the C library has no ``mallinfo2``.

    Blocks below the mmap threshold come from the heap, and a freed one stays with the
    process until it sits at the heap's top: resident memory that no tensor holds. Read at the
    end of a run it bounds what the heap held free at the peak, as long as the heap only grew:
    since then its size can only have risen and its live blocks fallen."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().fordblks / 2**20


def minor_faults() -> int | None:
    """This process's minor page faults so far, every thread's (``getrusage``'s ``ru_minflt``:
    pages it touched that were not yet resident, which the kernel maps and zeroes), or None
    where there is no ``getrusage`` (Windows)."""
    try:
        import resource  # lazy: Unix only (Windows has no getrusage)
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
