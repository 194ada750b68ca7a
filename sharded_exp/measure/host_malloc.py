"""A rank's host allocator: glibc's own mmap threshold by default, or fixed at 4 MiB so freed large blocks go back.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB by default) with a
mapping of its own and unmaps it on ``free``. Left to itself the threshold is *dynamic*
(mallopt(3)): when a mapped block is freed, the threshold rises to that block's size (up to
32 MiB on 64-bit) and the trim threshold to twice it. From then on every block of that size
or smaller comes from the heap, and a freed heap block stays resident until it sits at the
heap's top above the trim threshold, which blocks freed out of order seldom do.

A FSDP rank frees one unit's gathered parameters and gradients after every unit, each
several MiB: after the first, the threshold has risen past them, and each later gather is
carved from the heap around blocks still live, so the rank's resident set grows by
hundreds of MiB that no live tensor holds (docs/concepts/memory.md, "On CPU: resident
memory"). Setting the threshold explicitly turns the adjustment off (mallopt(3)).

Where to fix it is a trade between resident memory and speed. A mapped block is new pages
every time it is allocated, and the kernel faults in (and zeroes) each page on first touch.
At glibc's 128 KiB a gpt small rank mapped every activation anew each step: about 22,000
page faults and 40% of its step (docs/concepts/speed.md, "A CPU rank's page faults"). At
4 MiB a step's activations of the models a CPU trains come from the heap and are reused, as
in a process left alone, while a unit's gather (the whole unit's parameters in one buffer),
an 8 MiB weight or its gradient are still mapped and given back.

The default (``trainer.host_mmap_threshold=dynamic``) leaves glibc's rule, as your own script
has it: a step's blocks up to 32 MiB come from the heap and are reused, and a FSDP rank's
resident set keeps its freed gathers. ``=fixed`` spares that resident memory at the price of
new pages every step for every block of 4 MiB or more (a 1024-wide layer's weight gradient,
Adam's temporaries). Every strategy runs under the one rule chosen. Both costs are measured in
docs/figures.md ("The ranks' mmap threshold: fixed or glibc's"); the default was ``fixed``
until that page's figures showed what it cost a step.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (<malloc.h>)."""

MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
"""The threshold a rank fixes: blocks of 4 MiB or more are mapped, and unmapped when freed."""

DYNAMIC_THRESHOLD_MAX = 32 * 1024 * 1024
"""How high glibc's dynamic threshold rises on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX`` in
malloc.c, mallopt(3)): a larger block is mapped every time, however the threshold moved."""


def fix_mmap_threshold(env=os.environ) -> int | None:
    """Fix this process's mmap threshold at :data:`MMAP_THRESHOLD_BYTES`; the bytes set, or None.

    None when the process's environment sets glibc's malloc itself (``MALLOC_MMAP_THRESHOLD_``,
    or ``glibc.malloc`` in ``GLIBC_TUNABLES``: your setting stands, dynamic or not), or when the
    C library is not glibc (musl, macOS: no dynamic threshold to turn off).
    """
    return None if _yours(env) else _mallopt_threshold(MMAP_THRESHOLD_BYTES)


def _yours(env) -> bool:
    """Whether ``env`` sets glibc's malloc itself (then nothing here touches it)."""
    return "MALLOC_MMAP_THRESHOLD_" in env or "glibc.malloc" in env.get("GLIBC_TUNABLES", "")


_fixed_here = False
"""Whether this process fixed its threshold already: glibc cannot go back to its dynamic rule."""


def _mallopt_threshold(nbytes: int) -> int | None:
    global _fixed_here
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library, no search for a file
        libc.gnu_get_libc_version  # only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        return None
    _fixed_here = True
    return nbytes


def set_mmap_threshold(rule: str, env=os.environ) -> int | None:
    """A rank's ``trainer.host_mmap_threshold``: ``"fixed"`` fixes the threshold
    (:func:`fix_mmap_threshold`), ``"dynamic"`` leaves glibc's rule; the bytes fixed, or None.

    A process that fixed it for an earlier job (torchrun's ranks run a ``-m`` sweep's jobs in
    one process) cannot give glibc its dynamic rule back: there ``"dynamic"`` fixes the
    threshold at the dynamic rule's maximum (32 MiB), the steady state that rule reaches and
    the time model assumes for it (:func:`mapped_from`)."""
    if rule not in ("fixed", "dynamic"):
        raise ValueError(f"trainer.host_mmap_threshold={rule!r} must be 'fixed' or 'dynamic'")
    if rule == "fixed":
        return fix_mmap_threshold(env)
    return _mallopt_threshold(DYNAMIC_THRESHOLD_MAX) if _fixed_here and not _yours(env) else None


def mapped_from(env=os.environ, fixed: bool = False) -> int | None:
    """The smallest block a rank's glibc maps anew each time it is asked for, in a steady
    state (bytes): the threshold the rank fixes (:func:`fix_mmap_threshold`; ``fixed``:
    ``trainer.host_mmap_threshold=fixed``); the one you set (``MALLOC_MMAP_THRESHOLD_``, or
    ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``); left dynamic (not ``fixed``, or
    other ``glibc.malloc`` tunables) only blocks above its maximum are always mapped. None
    where the C library is not glibc (not modelled).

    Each such block is new pages, which the kernel faults in (and zeroes) when they are first
    written: the time model prices them (:attr:`~sharded_exp.speed.profiles.DeviceProfile.fresh_page_s`)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    tunables = dict(
        item.split("=", 1) for item in env.get("GLIBC_TUNABLES", "").replace(":", " ").split() if "=" in item
    )
    mine = env.get("MALLOC_MMAP_THRESHOLD_", tunables.get("glibc.malloc.mmap_threshold"))
    if mine is not None:
        try:
            return int(mine)
        except ValueError:
            return DYNAMIC_THRESHOLD_MAX  # glibc ignores a setting it cannot read
    if not fixed or any(k.startswith("glibc.malloc") for k in tunables):
        return DYNAMIC_THRESHOLD_MAX
    return MMAP_THRESHOLD_BYTES


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
