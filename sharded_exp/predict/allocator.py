"""A model of torch's CUDA caching allocator: what ``torch.cuda.memory_stats()`` would say.

The planner counts the bytes a step's tensors hold. The CUDA caching allocator hands those
tensors rounded blocks carved out of cached segments, and what a run can OOM on is the
segments it reserved (plus the CUDA context, outside every counter). This module replays
a sequence of allocations and frees through the allocator's rules and reports the
allocator's own statistics: allocated bytes (rounded blocks), reserved bytes (segments),
active blocks, segment count, inactive split blocks, each current and peak.

    from sharded_exp.predict.allocator import Allocator, parse_alloc_conf
    alloc = Allocator(parse_alloc_conf("expandable_segments:True"), device_bytes=80 * 2**30)
    h = alloc.malloc(16_000_000)           # a Linear(2000, 2000) weight
    alloc.free(h)
    alloc.stats()["reserved_bytes.all.peak"]

Source read (not guessed). pytorch/pytorch as the ``read_file`` tool stores it:
``c10/cuda/CUDACachingAllocator.cpp`` at commit 001074d2 (``DeviceCachingAllocator``, settings
from ``CUDAAllocatorConfig``) and ``c10/core/AllocatorConfig.cpp`` at 065861fb
(``AllocatorConfig::parseArgs``). Newer copies of the same files, found by content search (the
search names no repository or commit), show the layout torch >= 2.10 uses:
``AcceleratorAllocatorConfig`` (``c10/core/AllocatorConfig.h``/``.cpp``, with
``large_segment_size_mb``), ``CUDAAllocatorConfig.h`` (the CUDA-only keys, among them
``per_process_memory_fraction``) and a ``DeviceCachingAllocator`` whose memory cap is optional.
torch 2.13.0 is installed here without its C++ source; where the copies differ this module
follows the newer one and says so below. Functions named below are the C++ ones.

The rules modelled
------------------
- ``round_size``: requests below 512 bytes (kMinBlockSize) take 512; others round up to a
  multiple of 512, or, when ``roundup_power2_divisions`` gives the size's power-of-two
  interval (1 MiB .. 64 GiB, 16 intervals) more than one division and the size exceeds
  512 x divisions, up to the next division of that interval (``roundup_power2_next_division``).
- ``get_pool``: rounded sizes <= 1 MiB (kSmallSize) use the small pool, others the large.
- ``get_allocation_size``: a new segment is 2 MiB (kSmallBuffer) for the small pool,
  ``large_segment_size`` (default 20 MiB = kLargeBuffer; older torch: always kLargeBuffer) for
  sizes under 10 MiB (kMinLargeAlloc), else the size rounded up to 2 MiB (kRoundLarge).
- ``get_free_block``: best fit: the smallest cached block of the same stream and pool,
  ordered by (stream, size, address) (``BlockComparatorSize``). With ``max_split_size_mb``:
  a request below it never takes a block at or above it; a request at or above it takes a
  block only if the block is smaller than the request + ``max_non_split_rounding_mb``
  (default: the large segment size, 20 MiB; torch < 2.5 hard-codes kLargeBuffer).
- ``should_split``: the small pool (and every pool under expandable segments) splits when the
  remainder is >= 512 bytes; the large pool when the request is below ``max_split_size``
  and the remainder is > 1 MiB. An unsplit block is handed out whole and counts whole in
  ``allocated_bytes`` (this is why a 16,000,000-byte weight counts 16 MiB).
- ``free_block``: a freed block merges with free neighbours of its segment
  (``try_merge_blocks``) and goes back to its pool; ``release_block`` returns whole
  (unsplit) segments to the device.
- ``malloc``: cached block, else (gc, see below) a new segment; if the device refuses it,
  ``release_available_cached_blocks`` (only with ``max_split_size_mb``: free the oversize
  cached blocks of that stream, the smallest one that covers the request, else the largest
  first) and retry; then ``release_cached_blocks`` (synchronise every stream, free every
  unsplit cached segment, unmap free expandable pages) and retry; then OOM
  (:class:`AllocatorOOM`, naming the request).
- memory cap: ``set_per_process_memory_fraction`` or ``per_process_memory_fraction`` below 1.0
  caps reserved memory at that share of the device (``alloc_block``'s first check).
- ``garbage_collect_cached_blocks``: only under a memory cap (the source gates it on one) and a
  threshold > 0: before a new segment, if reserved exceeds threshold x the cap, free unsplit,
  non-expandable large-pool cached blocks whose age (``get_free_block`` calls on that pool
  since they were cached) is at least the average, repeating until enough is reclaimed.
- expandable segments (``try_allocate_expandable_block``, ``map_block``, ``unmap_block``):
  one virtual segment per stream and pool, 1 1/8 of the device's memory wide, mapped in
  pages of 2 MiB (small pool) or the large segment size (20 MiB) at the lowest address with
  room; mapped pages count as reserved. The mapping adds no ``segment`` count and no
  ``inactive_split`` (the source counts neither). ``release_cached_blocks`` unmaps whole
  free pages.
- streams: a freed block is reused only by its own stream. ``record_stream(h, s)`` on
  another stream makes ``free(h)`` record an event on ``s``; the block stays active (not
  reusable, not mergeable) until that event completes and the next ``malloc`` processes it
  (``process_events``). This model's event rule: **an event completes when its stream is
  synchronised** (:meth:`Allocator.synchronize`), or at ``release_cached_blocks``
  (``synchronize_and_free_events``). Before that, the stream's work is taken as unfinished.

Not modelled: CUDA graph private pools and MemPools, the ``cudaMallocAsync`` backend,
free-memory callbacks, IPC, peer access, and the exact addresses cudaMalloc returns (the
model hands out increasing addresses, so ties in (stream, size) go to the older segment).

Warning:
    ``device_bytes`` is the memory the allocator may take, i.e. the device's total minus
    the CUDA context and anything else outside torch. An OOM here means the real run needs
    more than that; the real OOM can come sooner if other processes hold memory.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Hashable, Iterable, Optional

KIB = 1024
MIB = 1024 * KIB
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded to a multiple of 512 bytes
K_SMALL_SIZE = 1 * MIB  # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small-pool segments (and small expandable pages)
K_LARGE_BUFFER = 20 * MIB  # kLargeBuffer: segments for 1-10 MiB requests (and large pages)
K_MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: from here a segment is the request, rounded
K_ROUND_LARGE = 2 * MIB  # kRoundLarge: large segments are rounded up to 2 MiB
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB
UNLIMITED = 2**64 - 1  # max_split_size's default: size_t max

STAT_TYPES = ("all", "small_pool", "large_pool")

# Boolean options: key -> AllocatorSettings field. The CUDA keys are those of
# CUDAAllocatorConfig::getKeys (HIP spellings accepted too), the rest AcceleratorAllocatorConfig's.
_BOOL_KEYS = {
    "expandable_segments": "expandable_segments",
    "pinned_use_background_threads": "pinned_use_background_threads",
    "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register": "pinned_use_host_register",
    "pinned_use_hip_host_register": "pinned_use_host_register",
    "graph_capture_record_stream_reuse": "graph_capture_record_stream_reuse",
    "pinned_free_catch_all": "pinned_free_catch_all",
    "throw_on_cudamalloc_oom": "throw_on_cudamalloc_oom",
}
_PINNED_INT_KEYS = {
    "pinned_num_register_threads": "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb": "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb": "pinned_max_round_threshold",  # MiB, kept in bytes (torch 2.13)
    "pinned_max_cached_size_mb": "pinned_max_cached_size",
}
"""Whole-number pinned-memory options: key -> AllocatorSettings field."""
ALLOC_CONF_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
"""Every option the parser knows (torch's AcceleratorAllocatorConfig and CUDAAllocatorConfig keys;
the last two are torch 2.13's, for pinned host memory: :mod:`sharded_exp.predict.host_memory`)."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The caching allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` sets them.

    Build one with :func:`parse_alloc_conf`; the defaults are torch's with the variable unset.
    Only the fields above ``backend`` change what the model computes; the rest are parsed so a
    valid string is accepted, and kept so a plan can echo them.
    """

    large_segment_size: int = K_LARGE_BUFFER
    """Bytes; the segment for 1-10 MiB requests and the large pool's expandable page (> 10 MiB)."""
    max_split_size: int = UNLIMITED
    """Bytes; blocks at or above it are never split (``max_split_size_mb`` >= large segment)."""
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    """Bytes; an oversize cached block serves a request only if smaller than request + this."""
    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory above which cached blocks are freed by age (0: off)."""
    roundup_power2_divisions: tuple = (0,) * ROUNDUP_INTERVALS
    """Divisions per power-of-two interval [1 MiB, 2 MiB), [2, 4), ... (0 or 1: plain 512 rounding)."""
    expandable_segments: bool = False
    """One growing segment per stream and pool instead of one cudaMalloc per segment."""
    per_process_memory_fraction: float = 1.0
    """The allowed share of the device's memory; below 1.0 it caps reserved memory and enables gc."""
    backend: str = "native"
    """``native`` (this model) or ``cudaMallocAsync`` (not modelled)."""
    release_lock_on_cudamalloc: bool = False
    pinned_use_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_use_background_threads: bool = False
    pinned_reserve_segment_size_mb: int = 0
    graph_capture_record_stream_reuse: bool = False
    pinned_free_catch_all: bool = False
    throw_on_cudamalloc_oom: bool = False
    pinned_max_round_threshold: int = UNLIMITED
    """Bytes; a pinned host request above it is not rounded up to a power of two (torch 2.13)."""
    pinned_max_cached_size: int = UNLIMITED
    """Bytes; a pinned host request above it is neither rounded nor cached when freed (torch 2.13)."""

    def divisions(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the divisions of size's interval."""
        index = size.bit_length() - 1 - 20  # log2(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def _lex(conf: str) -> list:
    """``ConfigTokenizer``: ',', ':', '[' and ']' are tokens of their own; whitespace is dropped."""
    tokens, buf = [], []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Tokens:
    """The token list with the checks ``ConfigTokenizer`` makes, raising ValueError (torch: RuntimeError)."""

    def __init__(self, conf: str):
        self.conf, self.tok = conf, _lex(conf)

    def fail(self, message: str):
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {self.conf!r}: {message}")

    def at(self, i: int, what: str) -> str:
        if i >= len(self.tok):
            self.fail(f"{what} is missing at the end")
        return self.tok[i]

    def expect(self, i: int, c: str) -> None:
        if self.at(i, repr(c)) != c:
            self.fail(f"expected {c!r} at token {i}, got {self.tok[i]!r}")

    def integer(self, i: int, key: str) -> int:
        text = self.at(i, f"the value of {key}")
        if not text.isdigit():
            self.fail(f"{key} takes a non-negative integer, got {text!r}")
        return int(text)

    def number(self, i: int, key: str) -> float:
        text = self.at(i, f"the value of {key}")
        try:
            return float(text)
        except ValueError:
            self.fail(f"{key} takes a number, got {text!r}")

    def boolean(self, i: int, key: str) -> bool:
        text = self.at(i, f"the value of {key}")
        if text not in ("True", "False"):
            self.fail(f"{key} takes True or False, got {text!r}")
        return text == "True"

    def skip_value(self, i: int) -> int:
        """``skipKey``: from a key to the index of its value (its closing ']' for a list)."""
        self.expect(i + 1, ":")
        i += 2
        if self.at(i, "a value") == "[":
            while i < len(self.tok) and self.tok[i] != "]":
                i += 1
            if i == len(self.tok):
                self.fail("a list has no closing ']'")
        return i


def _parse_divisions(t: _Tokens, i: int, divs: list) -> int:
    """``parseRoundUpPower2Divisions``: ``N`` for every interval, or ``[MiB:N, ..., >:N]``.

    In the list form the first interval named also sets every interval below it, and ``>``
    sets every interval after the last one named (torch < 2.9 started that fill at the last
    one named, overwriting it; this follows the newer source).
    """
    key = "roundup_power2_divisions"
    t.expect(i + 1, ":")
    i += 2
    if t.at(i, f"the value of {key}") != "[":
        d = t.integer(i, key)
        if not _is_pow2(d):
            t.fail(f"{key} must be a power of 2, got {d}")
        divs[:] = [d] * ROUNDUP_INTERVALS
        return i
    first, last_index = True, 0
    i += 1
    while i < len(t.tok) and t.tok[i] != "]":
        boundary = t.tok[i]
        t.expect(i + 1, ":")
        i += 2
        d = t.integer(i, key)
        if d != 0 and not _is_pow2(d):
            t.fail(f"{key} divisions must be 0 or a power of 2, got {d}")
        if boundary == ">":
            divs[last_index + 1 :] = [d] * (ROUNDUP_INTERVALS - last_index - 1)
        else:
            if not boundary.isdigit() or not _is_pow2(int(boundary)):
                t.fail(f"{key} intervals must be powers of 2 (MiB) or '>', got {boundary!r}")
            index = min(int(boundary).bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divs[:index] = [d] * index
                first = False
            divs[index] = d
            last_index = index
        if t.at(i + 1, "']'") != "]":
            t.expect(i + 1, ",")
            i += 1
        i += 1
    t.expect(i, "]")
    return i


def parse_alloc_conf(conf: Optional[str]) -> AllocatorSettings:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string as torch does (``AcceleratorAllocatorConfig::parseArgs``
    then ``CUDAAllocatorConfig::parseArgs``).

    ``None`` or ``""`` gives torch's defaults. ``large_segment_size_mb`` is read first, as torch
    does, because it is the default of ``max_non_split_rounding_mb`` and the least
    ``max_split_size_mb`` may be. Raises ValueError naming the bad option or value and, for an
    unknown option, every known one (torch raises when CUDA starts; a plan should fail first).
    """
    s = AllocatorSettings()
    if not conf:
        return s
    t = _Tokens(conf)
    n = len(t.tok)
    large = K_LARGE_BUFFER
    for i, tok in enumerate(t.tok):
        if tok == "large_segment_size_mb" and (i == 0 or t.tok[i - 1] == ","):
            t.expect(i + 1, ":")
            mb = t.integer(i + 2, tok)
            if mb <= K_MIN_LARGE_ALLOC // MIB:
                t.fail(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MIB}, got {mb}")
            large = min(mb, UNLIMITED // MIB) * MIB
    s = replace(s, large_segment_size=large, max_non_split_rounding_size=large)
    divs = list(s.roundup_power2_divisions)
    i = 0
    while i < n:
        key = t.tok[i]
        if key == "large_segment_size_mb":
            i = t.skip_value(i)  # read above
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            t.expect(i + 1, ":")
            i += 2
            mb = t.integer(i, key)
            if mb < large // MIB:
                t.fail(f"{key} must be >= {large // MIB} (the large segment size in MiB), got {mb}")
            name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            s = replace(s, **{name: min(mb, UNLIMITED // MIB) * MIB})
        elif key == "garbage_collection_threshold":
            t.expect(i + 1, ":")
            i += 2
            frac = t.number(i, key)
            if not 0.0 < frac < 1.0:
                t.fail(f"{key} must lie in (0.0, 1.0), got {frac}")
            s = replace(s, garbage_collection_threshold=frac)
        elif key == "per_process_memory_fraction":
            t.expect(i + 1, ":")
            i += 2
            frac = t.number(i, key)
            if not 0.0 <= frac <= 1.0:
                t.fail(f"{key} must lie in [0.0, 1.0], got {frac}")
            s = replace(s, per_process_memory_fraction=frac)
        elif key == "roundup_power2_divisions":
            i = _parse_divisions(t, i, divs)
        elif key == "backend":
            t.expect(i + 1, ":")
            i += 2
            b = t.at(i, "the value of backend")
            if b not in ("native", "cudaMallocAsync"):
                t.fail(f"backend must be 'native' or 'cudaMallocAsync', got {b!r}")
            s = replace(s, backend=b)
        elif key in _BOOL_KEYS:
            t.expect(i + 1, ":")
            i += 2
            s = replace(s, **{_BOOL_KEYS[key]: t.boolean(i, key)})
        elif key in _PINNED_INT_KEYS:
            t.expect(i + 1, ":")
            i += 2
            v = t.integer(i, key)
            if key == "pinned_num_register_threads" and not (_is_pow2(v) and v <= 128):
                t.fail(f"{key} must be a power of 2 up to 128, got {v}")
            v = min(v, UNLIMITED // MIB) * MIB if key.startswith("pinned_max") else v  # MiB, kept in bytes
            s = replace(s, **{_PINNED_INT_KEYS[key]: v})
        else:
            t.fail(f"unknown option {key!r}; the options are {', '.join(ALLOC_CONF_KEYS)}")
        if i + 1 < n:
            t.expect(i + 1, ",")
            i += 1
        i += 1
    return replace(s, roundup_power2_divisions=tuple(divs))


def alloc_conf_from_env(environ=None) -> Optional[str]:
    """The allocator settings string a CUDA process would read: ``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF`` (the order of ``CUDAAllocatorConfig::instance``); None if neither is set."""
    env = os.environ if environ is None else environ
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    return conf if conf is not None else env.get("PYTORCH_ALLOC_CONF")


def round_size(size: int, settings: AllocatorSettings = AllocatorSettings()) -> int:
    """``round_size``: the block size the allocator hands out for a request of ``size`` bytes."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = settings.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if _is_pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def allocation_size(size: int, settings: AllocatorSettings = AllocatorSettings()) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a rounded size no cached block serves."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return settings.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class AllocatorOOM(MemoryError):
    """The allocator could not serve a request even after freeing its cache (torch's OutOfMemoryError)."""

    def __init__(self, size: int, alloc_size: int, stream, allocated: int, reserved: int, capacity):
        self.size, self.alloc_size, self.stream = size, alloc_size, stream
        self.allocated, self.reserved, self.capacity = allocated, reserved, capacity
        super().__init__(
            f"CUDA out of memory (modelled): tried to allocate {alloc_size / MIB:.2f} MiB for a request of "
            f"{size} bytes on stream {stream}; {allocated / MIB:.2f} MiB allocated, {reserved / MIB:.2f} MiB "
            f"reserved, of {capacity / MIB if capacity else float('inf'):.2f} MiB the allocator may use"
        )


class _Block:
    __slots__ = (
        "addr",
        "size",
        "stream",
        "small",
        "allocated",
        "requested",
        "prev",
        "next",
        "mapped",
        "seg",
        "stream_uses",
        "event_count",
        "gc_base",
    )

    def __init__(self, addr, size, stream, small, seg=None, mapped=True):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated = False
        self.requested = 0
        self.prev = self.next = None
        self.mapped = mapped
        self.seg = seg  # an _ExpandableSegment, or None for a cudaMalloc segment
        self.stream_uses = None
        self.event_count = 0
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool``: cached free blocks sorted by (stream, size, address); unmapped by (stream, address)."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list = []
        self.by_addr: dict = {}
        self.unmapped: list = []  # (stream, addr)
        self.unmapped_by_addr: dict = {}
        self.calls = 0  # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:
        b.gc_base = self.calls
        bisect.insort(self.keys, (b.stream, b.size, b.addr))
        self.by_addr[b.addr] = b

    def remove(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, (b.stream, b.size, b.addr))
        del self.keys[i]
        del self.by_addr[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped, (b.stream, b.addr))
        self.unmapped_by_addr[b.addr] = b

    def remove_unmapped(self, b: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, (b.stream, b.addr))
        del self.unmapped[i]
        del self.unmapped_by_addr[b.addr]


class _ExpandableSegment:
    __slots__ = ("base", "page", "span")

    def __init__(self, base: int, page: int, span: int):
        self.base, self.page, self.span = base, page, span


class _Stat:
    __slots__ = ("current", "peak")

    def __init__(self):
        self.current = self.peak = 0

    def add(self, n: int) -> None:
        self.current += n
        if self.current > self.peak:
            self.peak = self.current


_STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)


@dataclass
class ReplayResult:
    """What :meth:`Allocator.replay` returns: the peaks, and the OOM if one ended the replay."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    peak_segments: int
    fragmentation_at_peak_reserved_bytes: int
    """Reserved minus allocated at the moment reserved last reached its peak."""
    events: int
    oom: Optional[AllocatorOOM] = None
    stats: dict = field(default_factory=dict)


class Allocator:
    """One device's caching allocator (``DeviceCachingAllocator``), replayed in Python.

    Args:
        settings: from :func:`parse_alloc_conf`; defaults to torch's.
        device_bytes: memory the allocator may reserve before cudaMalloc fails (the device's
            total minus the CUDA context and other users). ``None``: unlimited, no OOM.
        memory_fraction: as ``torch.cuda.set_per_process_memory_fraction`` (default: the
            settings' ``per_process_memory_fraction``). Below 1.0 it caps reserved memory at
            that share of ``device_total_bytes`` and turns ``garbage_collection_threshold`` on
            (the source runs gc only with a cap); 1.0 sets no cap (torch >= 2.10; older torch
            set a cap at 1.0 too).
        device_total_bytes: the device's memory (``totalGlobalMem``): what the fraction is of;
            defaults to ``device_bytes``.

    Every operation is O(log n) searches plus list inserts (bisect on sorted lists).

    Warning:
        Handles are the model's own integers; they are not addresses. A handle freed twice,
        or unknown, raises KeyError.
    """

    def __init__(
        self,
        settings: Optional[AllocatorSettings] = None,
        device_bytes: Optional[int] = None,
        memory_fraction: Optional[float] = None,
        device_total_bytes: Optional[int] = None,
    ):
        self.settings = settings or AllocatorSettings()
        if self.settings.backend != "native":
            raise ValueError(f"the allocator model covers backend 'native' only, not {self.settings.backend!r}")
        self.device_bytes = device_bytes
        self.device_total = device_total_bytes or device_bytes
        fraction = self.settings.per_process_memory_fraction if memory_fraction is None else memory_fraction
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"memory_fraction must lie in [0, 1], got {fraction}")
        self.set_fraction = fraction < 1.0  # setMemoryFraction: allowed_memory_maximum only below 1
        self.allowed = None
        if self.set_fraction:
            if self.device_total is None:
                raise ValueError("a memory fraction below 1 needs device_total_bytes (or device_bytes)")
            self.allowed = int(fraction * self.device_total)
        self._space = self.device_total or 2**40  # sizes expandable segments' address space
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.stats_ = {name: {t: _Stat() for t in STAT_TYPES} for name in _STAT_NAMES}
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0
        self.num_sync_all_streams = 0
        self.total_reserved = 0  # total_allocated_memory
        self._next_addr = 1 << 40
        self._handles: dict = {}
        self._next_handle = 0
        self._events: dict = {}  # stream -> deque of (seq, block)
        self._event_seq = 0
        self._synced: dict = {}  # stream -> last seq completed by synchronize
        self._sync_all_seq = 0
        self._stream_ids: dict = {0: 0}
        self._gc_on = self.set_fraction and self.settings.garbage_collection_threshold > 0.0

    # --- statistics -------------------------------------------------------------------------------
    def _add(self, name: str, small: bool, n: int) -> None:
        s = self.stats_[name]
        s["all"].add(n)
        s["small_pool" if small else "large_pool"].add(n)

    def stats(self) -> dict:
        """The statistics, under ``torch.cuda.memory_stats()``'s flat names
        (``allocated_bytes.all.current``, ``reserved_bytes.large_pool.peak``, ``segment.all.current``, ...)."""
        out = {}
        for name, per_type in self.stats_.items():
            for t, st in per_type.items():
                out[f"{name}.{t}.current"] = st.current
                out[f"{name}.{t}.peak"] = st.peak
        out.update(
            num_alloc_retries=self.num_alloc_retries,
            num_ooms=self.num_ooms,
            num_device_alloc=self.num_device_alloc,
            num_device_free=self.num_device_free,
            num_sync_all_streams=self.num_sync_all_streams,
        )
        return out

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: every peak becomes the current value."""
        for per_type in self.stats_.values():
            for st in per_type.values():
                st.peak = st.current

    # --- the public operations ---------------------------------------------------------------------
    def _sid(self, stream) -> int:
        """A stream's sort key: any hashable name (0, "nccl", "all_gather") maps to a small int."""
        sid = self._stream_ids.get(stream)
        if sid is None:
            sid = self._stream_ids[stream] = len(self._stream_ids)
        return sid

    def malloc(self, size: int, stream: Hashable = 0) -> int:
        """``DeviceCachingAllocator::malloc``: a handle to a block of at least ``size`` bytes on ``stream``.

        ``stream`` is any hashable name; 0 is the default stream. Raises :class:`AllocatorOOM`
        when no segment can be had even after freeing the cache.
        """
        name, stream = stream, self._sid(stream)
        self._process_events()
        rsize = round_size(size, self.settings)
        small = rsize <= K_SMALL_SIZE
        pool = self.small if small else self.large
        alloc_size = allocation_size(rsize, self.settings)
        block = self._get_free_block(pool, stream, rsize)
        if block is None:
            if self._gc_on:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, rsize, alloc_size, False)
            if block is None and self._release_available_cached_blocks(pool, stream, rsize):
                block = self._alloc_block(pool, stream, rsize, alloc_size, False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, rsize, alloc_size, True)
            if block is None:
                self.num_ooms += 1
                a = self.stats_["allocated_bytes"]["all"].current
                r = self.stats_["reserved_bytes"]["all"].current
                cap = self.allowed if self.set_fraction else self.device_bytes
                raise AllocatorOOM(size, alloc_size, name, a, r, cap)
        block = self._alloc_found_block(pool, block, rsize, size, self._should_split(block, rsize))
        h = self._next_handle
        self._next_handle += 1
        self._handles[h] = block
        return h

    def free(self, handle: int) -> None:
        """``DeviceCachingAllocator::free``: allocated bytes drop now; the block returns to its pool
        now, or, after :meth:`record_stream`, once every recorded stream has synchronised."""
        b = self._handles.pop(handle)
        b.allocated = False
        self._add("allocation", b.small, -1)
        self._add("allocated_bytes", b.small, -b.size)
        if b.stream_uses:
            for s in b.stream_uses:  # insert_events: one event per recorded stream
                self._event_seq += 1
                self._events.setdefault(s, deque()).append((self._event_seq, b))
                b.event_count += 1
            b.stream_uses = None
        else:
            self._free_block(b)

    def record_stream(self, handle: int, stream: Hashable) -> None:
        """``recordStream``: the block is also used on ``stream``; uses on its own stream are ignored."""
        b = self._handles[handle]
        stream = self._sid(stream)
        if stream == b.stream:
            return
        if b.stream_uses is None:
            b.stream_uses = set()
        b.stream_uses.add(stream)

    def synchronize(self, stream: Optional[Hashable] = None) -> None:
        """The work queued on ``stream`` (every stream if None) is done: its events complete.

        The blocks they held return to their pools at the next :meth:`malloc` (``process_events``).
        """
        if stream is None:
            self._sync_all_seq = self._event_seq
        else:
            self._synced[self._sid(stream)] = self._event_seq

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: ``release_cached_blocks``."""
        self._release_cached_blocks()

    def replay(self, events: Iterable) -> ReplayResult:
        """Run ``(op, id, size, stream)`` events; return the peaks (and the OOM if one stopped it).

        ops: ``malloc`` (``id`` names the allocation), ``free``, ``record_stream`` (``stream`` is the
        other stream), ``sync`` (``stream`` None: all), ``empty_cache``, ``reset_peak``.
        """
        live: dict = {}
        n = 0
        oom = None
        reserved = self.stats_["reserved_bytes"]["all"]
        allocated = self.stats_["allocated_bytes"]["all"]
        frag_at_peak = reserved.current - allocated.current
        peak_seen = reserved.peak
        for op, ident, size, stream in events:
            n += 1
            if op == "malloc":
                try:
                    live[ident] = self.malloc(size, stream)
                except AllocatorOOM as e:
                    oom = e
                    break
                if reserved.current >= peak_seen:
                    peak_seen = reserved.current
                    frag_at_peak = reserved.current - allocated.current
            elif op == "free":
                self.free(live.pop(ident))
            elif op == "record_stream":
                self.record_stream(live[ident], stream)
            elif op == "sync":
                self.synchronize(stream)
            elif op == "empty_cache":
                self.empty_cache()
            elif op == "reset_peak":
                self.reset_peak_stats()
                peak_seen = reserved.current
                frag_at_peak = reserved.current - allocated.current
            else:
                raise ValueError(
                    f"unknown replay op {op!r}; ops: malloc, free, record_stream, sync, empty_cache, reset_peak"
                )
        return ReplayResult(
            peak_allocated_bytes=allocated.peak,
            peak_reserved_bytes=reserved.peak,
            peak_active_bytes=self.stats_["active_bytes"]["all"].peak,
            peak_segments=self.stats_["segment"]["all"].peak,
            fragmentation_at_peak_reserved_bytes=frag_at_peak,
            events=n,
            oom=oom,
            stats=self.stats(),
        )

    # --- the rules ---------------------------------------------------------------------------------
    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.settings.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.settings.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Optional[_Block]:
        if self._gc_on:
            pool.calls += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = pool.by_addr[keys[i][2]]
        if b.seg is not None:
            if self.settings.expandable_segments:
                # best fit counts an expandable block at the size it can grow to (mapped + the
                # unmapped space right after it)
                def grow(x):
                    return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)

                while b.seg is not None and i + 1 < len(keys) and keys[i + 1][0] == stream:
                    nb = pool.by_addr[keys[i + 1][2]]
                    if grow(nb) >= grow(b):
                        break
                    i += 1
                    b = nb
            else:
                i += 1
                while i < len(keys) and keys[i][0] == stream and pool.by_addr[keys[i][2]].seg is not None:
                    i += 1
                if i == len(keys) or keys[i][0] != stream:
                    return None
                b = pool.by_addr[keys[i][2]]
        mss = self.settings.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + self.settings.max_non_split_rounding_size:
            return None
        pool.remove(b)
        return b

    def _alloc_found_block(self, pool: _Pool, b: _Block, size: int, orig: int, split: bool) -> _Block:
        already_split = b.is_split()
        if split:
            rest = b
            b = _Block(rest.addr, size, rest.stream, rest.small, rest.seg)
            b.prev = rest.prev
            if b.prev is not None:
                b.prev.next = b
            b.next = rest
            rest.prev = b
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
            if b.seg is None:
                if already_split:
                    self._add("inactive_split_bytes", b.small, -size)
                else:
                    self._add("inactive_split_bytes", b.small, rest.size)
                    self._add("inactive_split", b.small, 1)
        elif already_split and b.seg is None:
            self._add("inactive_split_bytes", b.small, -b.size)
            self._add("inactive_split", b.small, -1)
        b.allocated = True
        b.requested = orig
        self._add("allocation", b.small, 1)
        self._add("allocated_bytes", b.small, b.size)
        self._add("active", b.small, 1)
        self._add("active_bytes", b.small, b.size)
        self._add("requested_bytes", b.small, orig)
        return b

    def _free_block(self, b: _Block) -> None:
        pool = self.small if b.small else self.large
        original_size = b.size
        d_blocks = d_bytes = 0
        for other in (b.prev, b.next):
            subsumed = self._try_merge(b, other, pool)
            if subsumed:
                d_blocks -= 1
                d_bytes -= subsumed
        pool.insert(b)
        if b.is_split():
            d_blocks += 1
            d_bytes += b.size
        if b.seg is None:
            if d_blocks:
                self._add("inactive_split", b.small, d_blocks)
            if d_bytes:
                self._add("inactive_split_bytes", b.small, d_bytes)
        self._add("active", b.small, -1)
        self._add("active_bytes", b.small, -original_size)
        self._add("requested_bytes", b.small, -b.requested)

    def _try_merge(self, dst: _Block, src: Optional[_Block], pool: _Pool) -> int:
        if src is None or src.allocated or src.event_count > 0 or src.stream_uses or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _new_addr(self, span: int) -> int:
        addr = self._next_addr
        # bases are whole large pages apart (pages are counted from each segment's base)
        page = self.settings.large_segment_size
        self._next_addr += -(-span // page) * page + page
        return addr

    def _device_refuses(self, nbytes: int) -> bool:
        return self.device_bytes is not None and self.total_reserved + nbytes > self.device_bytes

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int, retry: bool) -> Optional[_Block]:
        if retry:
            self.num_alloc_retries += 1
        if self.set_fraction and self.total_reserved + alloc_size > self.allowed:
            return None
        if self.settings.expandable_segments:
            return self._try_allocate_expandable(pool, stream, size)
        if self._device_refuses(alloc_size):
            return None
        self.total_reserved += alloc_size
        b = _Block(self._new_addr(alloc_size), alloc_size, stream, pool.small)
        self._add("segment", pool.small, 1)
        self._add("reserved_bytes", pool.small, alloc_size)
        self.num_device_alloc += 1
        return b

    # --- expandable segments -------------------------------------------------------------------------
    def _allocatable(self, b: Optional[_Block]) -> bool:
        return b is not None and not b.allocated and b.event_count == 0 and not b.stream_uses

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        um = pool.unmapped
        i = bisect.bisect_left(um, (stream, -1))
        while i < len(um) and um[i][0] == stream:
            c = pool.unmapped_by_addr[um[i][1]]
            if self._allocatable(c.prev):
                c = c.prev
            room, x = 0, c
            while room < size and self._allocatable(x):
                room += x.size
                x = x.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.small else self.settings.large_segment_size
        span = -(-(self._space + self._space // 8) // page) * page
        seg = _ExpandableSegment(self._new_addr(span), page, span)
        c = _Block(seg.base, span, stream, pool.small, seg, mapped=False)
        pool.insert_unmapped(c)
        return c

    def _map_block(self, b: _Block, size: int, pool: _Pool) -> bool:
        page = b.seg.page
        mapped = -(-size // page) * page  # b.addr is page aligned: unmapped blocks always are
        if self._device_refuses(mapped):
            return False
        pool.remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, b.stream, b.small, b.seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            pool.insert_unmapped(rest)
            b.size = mapped
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self.total_reserved += mapped
        self._add("reserved_bytes", b.small, mapped)
        self.num_device_alloc += 1
        return True

    def _try_allocate_expandable(self, pool: _Pool, stream: int, size: int) -> Optional[_Block]:
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size), pool):
                return None
            c = nxt  # map_block merged c into nxt
        pool.remove(c)
        return c

    def _unmap_block(self, b: _Block, pool: _Pool) -> None:
        seg = b.seg
        page = seg.page
        off = b.addr - seg.base
        begin = seg.base + -(-off // page) * page
        end = seg.base + ((off + b.size) // page) * page
        if begin >= end:
            return
        pool.remove(b)
        if begin > b.addr:
            before = _Block(b.addr, begin - b.addr, b.stream, b.small, seg)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.insert(before)
        after_size = b.addr + b.size - end
        if after_size > 0:
            after = _Block(end, after_size, b.stream, b.small, seg)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.insert(after)
        b.addr, b.size, b.mapped = begin, end - begin, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.total_reserved -= end - begin
        self._add("reserved_bytes", b.small, -(end - begin))
        self.num_device_free += 1

    # --- giving memory back ---------------------------------------------------------------------------
    def _release_block(self, b: _Block, pool: _Pool) -> None:
        pool.remove(b)
        self.total_reserved -= b.size
        self._add("segment", b.small, -1)
        self._add("reserved_bytes", b.small, -b.size)
        self.num_device_free += 1

    def _release_blocks(self, pool: _Pool) -> None:
        to_unmap = []
        for key in list(pool.keys):
            b = pool.by_addr[key[2]]
            if b.seg is not None:
                to_unmap.append(b)
            elif not b.is_split():
                self._release_block(b, pool)
        for b in to_unmap:
            self._unmap_block(b, pool)
            if not b.is_split() and not b.mapped:  # the whole segment is unmapped: drop it
                pool.remove_unmapped(b)

    def _release_cached_blocks(self) -> bool:
        self._synchronize_and_free_events()
        self._release_blocks(self.large)
        self._release_blocks(self.small)
        return True

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        mss = self.settings.max_split_size
        if mss == UNLIMITED:
            return False
        target = max(size, mss)
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream, target, -1))
        if i < len(keys) and keys[i][0] == stream and pool.by_addr[keys[i][2]].seg is None:
            self._release_block(pool.by_addr[keys[i][2]], pool)
            return True
        # no single block covers it: free oversize blocks of this stream, largest first
        released = 0
        i -= 1
        while i >= 0 and released < target:
            b = pool.by_addr[keys[i][2]]
            if b.stream != stream or b.size < mss:
                break
            if b.seg is None:
                self._release_block(b, pool)
                released += b.size
            i -= 1
        return released >= target

    def _garbage_collect(self) -> None:
        threshold = int(self.settings.garbage_collection_threshold * self.allowed)
        if self.total_reserved <= threshold:
            return
        target = self.total_reserved - threshold
        pool = self.large
        ages = {k: pool.calls - pool.by_addr[k[2]].gc_base for k in pool.keys if not pool.by_addr[k[2]].is_split()}
        if not ages:
            return
        total_age, count = sum(ages.values()), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            avg = total_age / count
            freed = False
            for k in list(pool.keys):
                b = pool.by_addr.get(k[2])
                if b is None or b.is_split() or b.seg is not None:
                    continue
                age = pool.calls - b.gc_base
                if age >= avg:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b, pool)

    # --- cross-stream frees ---------------------------------------------------------------------------
    def _event_done(self, stream: int, seq: int) -> bool:
        return seq <= self._sync_all_seq or seq <= self._synced.get(stream, 0)

    def _complete(self, b: _Block) -> None:
        b.event_count -= 1
        if b.event_count == 0:
            self._free_block(b)

    def _process_events(self) -> None:
        if not self._events:
            return
        for stream in list(self._events):
            q = self._events[stream]
            while q and self._event_done(stream, q[0][0]):
                self._complete(q.popleft()[1])
            if not q:
                del self._events[stream]

    def _synchronize_and_free_events(self) -> None:
        self.num_sync_all_streams += 1
        events, self._events = self._events, {}
        for q in events.values():
            for _, b in q:
                self._complete(b)


CUDA_CONTEXT_FILE = Path(__file__).with_name("cuda_context.json")


def cuda_context_entries() -> list:
    """Published CUDA context sizes (``cuda_context.json``), each with its source, torch version
    and device; the memory nvidia-smi shows on top of ``reserved_bytes``."""
    return json.loads(CUDA_CONTEXT_FILE.read_text())["entries"]
