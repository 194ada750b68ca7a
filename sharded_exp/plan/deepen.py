"""A deep model's allocation trace, drawn from the traces of shallow copies of it.

The caching allocator's reserved memory is not a share of the peak: a cache one stream's pool
keeps (FSDP2's all-gather copy-in buffers, a gradient left cached in the reduce-scatter
stream's pool) is the same at any depth, while each block's activations reuse segments that
the blocks before left. So a plan composed by depth (:mod:`sharded_exp.plan.depth`) asks the
allocator model itself (:mod:`sharded_exp.predict.allocator`), on the trace the whole model
would make: the shallow trace with one block's events repeated to the full depth. A block's
allocations are the same sizes at every depth, so the trace at ``n + 1`` blocks is the one at
``n`` with one block's events inserted:

- **the new block's allocations**: the allocations of the two traces aligned by a shortest
  edit script (Myers' diff), each compared by its size, its stream and whether the trace frees
  it. Those of the deeper trace that match none are the new block's, and so is every event on
  them (their frees and uses on NCCL's stream); the synchronisations the shallow trace has not
  got (one per collective) too. An allocation dropped from the shallow trace where one on the
  same stream with another size comes in (a DDP bucket not yet full, a tensor of one element
  per parameter) is one that grows by the difference with each block;
- **repeated**: each run of the new block's events is repeated in place, each copy with its own
  allocations; the grown sizes grow.

Blocks alike, the alignment may take the new block's allocations from two neighbouring blocks
(the tail of one, the head of the next), and a copy then comes in another order than the real
block's. The drawing is therefore checked as the lines of the peak are (:func:`drawn_to`): the
trace at ``n + 2`` blocks drawn from ``n`` and ``n + 1``, replayed, must add to its tensors'
peak what the one faked at ``n + 2`` adds (rounding and cache, within :data:`CHECK_REL`; the
tensors' peak itself is the composed plan's, from the lines and the analytic states). Where it does not
(FSDP2's prefetch puts a unit's all-gather in the block before's forward, and the copies of
that run, each held until its block runs, pile up), or the traces do not align, the caller
keeps the share of the peak (:func:`sharded_exp.plan.depth.compose_allocator`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_exp.predict.alloc_trace import replay


def _keys(events: list) -> list[tuple]:
    """Each event as the allocator sees it, without its id."""
    size, stream = {}, {}
    keys = []
    for op, ident, nbytes, st in events:
        if op == "malloc":
            size[ident], stream[ident] = nbytes, st
            keys.append(("malloc", nbytes, st))
        elif op == "free":
            keys.append(("free", size.get(ident), stream.get(ident)))
        elif op == "record_stream":
            keys.append(("record_stream", size.get(ident), st))
        else:
            keys.append((op, st))
    return keys


def _diff(a: list, b: list) -> list[tuple[int | None, int | None]]:
    """A shortest edit script from ``a`` to ``b`` (Myers, 1986) as ``(i, j)`` pairs in order:
    both set where ``a[i] == b[j]`` is kept, ``(i, None)`` deleted, ``(None, j)`` inserted."""
    n, m = len(a), len(b)
    start = 0  # the common head and tail cost nothing to find
    while start < n and start < m and a[start] == b[start]:
        start += 1
    end = 0
    while end < n - start and end < m - start and a[n - 1 - end] == b[m - 1 - end]:
        end += 1
    x_seq, y_seq = a[start : n - end], b[start : m - end]
    nx, ny = len(x_seq), len(y_seq)
    offset = nx + ny + 1
    v = [0] * (2 * offset + 1)
    trace = []
    found = False
    for d in range(nx + ny + 1):
        trace.append(v[offset - d : offset + d + 1])  # the frontier so far: k in [-d, d]
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]
            else:
                x = v[offset + k - 1] + 1
            y = x - k
            while x < nx and y < ny and x_seq[x] == y_seq[y]:
                x, y = x + 1, y + 1
            v[offset + k] = x
            if x >= nx and y >= ny:
                found = True
                break
        if found:
            break
    # walk back through the saved frontiers
    script: list[tuple[int | None, int | None]] = []
    x, y = nx, ny
    for d in range(len(trace) - 1, 0, -1):
        vd = trace[d]  # vd[d + k]: the furthest x on diagonal k after d - 1 edits
        k = x - y
        if k == -d or (k != d and vd[d + k - 1] < vd[d + k + 1]):
            prev_k = k + 1
        else:
            prev_k = k - 1
        prev_x = vd[d + prev_k]
        prev_y = prev_x - prev_k
        while x > prev_x and y > prev_y:
            x, y = x - 1, y - 1
            script.append((x, y))
        if x == prev_x:
            y -= 1
            script.append((None, y))
        else:
            x -= 1
            script.append((x, None))
    while x > 0 and y > 0:
        x, y = x - 1, y - 1
        script.append((x, y))
    script.reverse()
    shift = lambda p, s: None if p is None else p + s  # noqa: E731
    return (
        [(i, i) for i in range(start)]
        + [(shift(i, start), shift(j, start)) for i, j in script]
        + [(n - end + t, m - end + t) for t in range(end)]
    )


@dataclass
class Step:
    """What one more block adds to a trace (:func:`block_step`)."""

    events: list
    """The deeper trace's events."""
    new: list[bool]
    """Per event: the new block's (True) or one the shallower trace has too."""
    grown: dict[int, int]
    """Event index -> bytes more per block (an allocation whose size grows with depth)."""


def _allocations(events: list) -> tuple[list[int], list[tuple]]:
    """The allocations' indices, and each as the alignment compares it: its size, its stream
    and whether the trace frees it (a state kept against a temporary of the same size)."""
    freed = {e[1] for e in events if e[0] == "free"}
    at = [i for i, e in enumerate(events) if e[0] == "malloc"]
    return at, [(events[i][2], events[i][3], events[i][1] in freed) for i in at]


def block_step(shallow: list, deep: list) -> Step | None:
    """What the trace ``deep`` (one block more) adds to ``shallow``; None where it is not the
    shallow trace with a block's events inserted and sizes grown.

    The allocations are aligned first: those of the deeper trace matching none are the new
    block's, and so is every event on them (their frees and uses on other streams). The
    synchronisations (one per collective) are aligned with the rest."""
    ka, kb = _keys(shallow), _keys(deep)
    (ma, sa), (mb, sb) = _allocations(shallow), _allocations(deep)
    match: dict[int, int] = {}  # deep index -> shallow index (allocations)
    dropped: list[tuple[int, int]] = []  # (shallow index, the deep index it would have had)
    inserted: list[int] = []
    at = 0
    for i, j in _diff(sa, sb):
        if i is not None and j is not None:
            match[mb[j]], at = ma[i], mb[j] + 1
        elif i is not None:
            dropped.append((ma[i], at))
        else:
            inserted.append(mb[j])
    # A dropped allocation is one grown (a DDP bucket not yet full, one element per parameter):
    # the nearest inserted one on the same stream, of a size the shallow trace has not got.
    grown: dict[int, int] = {}
    free = set(inserted)
    known = set(ka)
    freed_b = {e[1] for e in deep if e[0] == "free"}
    freed_a = {e[1] for e in shallow if e[0] == "free"}
    for i, near in dropped:
        same = [j for j in free if kb[j][2] == ka[i][2] and (deep[j][1] in freed_b) == (shallow[i][1] in freed_a)]
        if not same:
            return None  # something of the shallow trace is not in the deeper one
        j = min(same, key=lambda j: (kb[j] in known, abs(j - near)))
        free.discard(j)
        match[j] = i
        grown[j] = kb[j][1] - ka[i][1]
    new_ids = {deep[j][1] for j in free}
    new = [e[0] != "sync" and (e[1] in new_ids) for e in deep]
    # the synchronisations: those the shallow trace has not got are the new block's
    old_b = [(j, k) for j, k in enumerate(kb) if not new[j]]
    keep = [(k[0], k[-1]) if k[0] == "sync" else ("event",) for k in ka]
    keep_b = [(k[0], k[-1]) if k[0] == "sync" else ("event",) for _, k in old_b]
    extra, moved = [], []
    for i, j in _diff(keep, keep_b):
        if j is not None and i is None:
            extra.append(j)
        elif i is not None and j is None:
            moved.append(keep[i])
    for kind in moved:  # a synchronisation moved past other events: the nearest of its kind
        j = next((j for j in extra if keep_b[j] == kind), None)
        if j is None:
            return None
        extra.remove(j)
    if any(keep_b[j][0] != "sync" for j in extra):
        return None  # an event on an allocation of the shallow trace that it has not got
    for j in extra:
        new[old_b[j][0]] = True
    return Step(list(deep), new, grown)


def deepen(step: Step, blocks: int) -> list:
    """The trace with ``blocks`` more blocks than ``step``'s deeper trace: each run of the new
    block's events repeated ``blocks`` more times right after itself (each copy with its own
    allocations), the grown sizes grown."""
    if blocks < 0:
        raise ValueError(f"a trace is deepened by 0 or more blocks, not {blocks}")
    new_ids = {e[1] for e, n in zip(step.events, step.new) if n and e[0] == "malloc"}

    def copy(event, k: int):
        op, ident, size, stream = event
        return op, ((ident, k) if ident in new_ids else ident), size, stream

    out: list = []
    run: list = []
    for index, (event, is_new) in enumerate(zip(step.events, step.new)):
        if is_new:
            out.append(event)
            run.append(event)
            continue
        out += [copy(e, k) for k in range(1, blocks + 1) for e in run]
        run = []
        op, ident, size, stream = event
        out.append((op, ident, size + blocks * step.grown.get(index, 0), stream))
    out += [copy(e, k) for k in range(1, blocks + 1) for e in run]
    return out


CHECK_REL = 0.05
"""The drawing holds where the trace drawn one block deeper replays to the faked one's
rounding and cache (allocated and reserved beyond the tensors' peak, what a composed plan
takes from it) within this share of the faked reserved peak. On a 1024-wide GPT at 8 ranks
DDP's and ZeRO-1's drawings are within 1-2%; FSDP2's 9% (its prefetch, module docstring)."""


def same_trace(a: tuple | None, b: tuple | None) -> bool:
    """Whether two fakes' traces (events, allocator setting, workspace) ask the allocator for
    the same: the same events in the same order, whatever their ids."""
    return a is not None and b is not None and a[1:] == b[1:] and _keys(a[0]) == _keys(b[0])


def drawn_to(a: list, b: list, c: list, blocks: int, alloc_conf: str | None = None) -> list | None:
    """The trace ``blocks`` blocks deeper than ``c``, where ``a``, ``b`` and ``c`` are the traces
    of the same model at three depths one block apart: drawn from ``b`` and ``c``, once the
    trace drawn from ``a`` and ``b`` adds to its tensors' peak what ``c``'s replay does
    (:data:`CHECK_REL`); None where the traces do not repeat so."""
    first = block_step(a, b)
    if first is None:
        return None
    faked, drawn = replay(c, alloc_conf), replay(deepen(first, 1), alloc_conf)
    for name in ("allocated_mib", "reserved_mib"):  # what rides on the composed peak: beyond the tensors'
        extra = getattr(drawn, name) - drawn.tracked_peak_mib - (getattr(faked, name) - faked.tracked_peak_mib)
        if abs(extra) > CHECK_REL * faked.reserved_mib:
            return None
    step = block_step(b, c)
    return None if step is None else deepen(step, blocks)
