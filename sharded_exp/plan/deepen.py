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
  same stream with another size comes in is the same allocation, grown by the difference with
  each block where it grows by the same bytes between the first two depths as between the
  last two (a DDP bucket not yet full, a tensor of one element per parameter:
  :func:`_grown_on_lines`); elsewhere (the rank faked steps other tensors at each depth where
  whole tensors are dealt out to ranks) its size is held;
- **repeated**: where the deeper trace is the shallow one with whole blocks inserted (a window
  of events in each stretch that repeats block after block: the forward's, the backward's, the
  optimizer's), each window is repeated right after itself, each copy's events referring to
  the allocations the block that many blocks on refers to (:func:`_repeat_periods`): FSDP2's
  prefetch gathers a unit inside the block before's forward and frees it inside the next
  block's, so copy ``k`` frees the unit copy ``k - 1`` gathered, and at most two are live as
  at any depth. Elsewhere each run of the new block's events is repeated in place, each copy
  with its own allocations (:func:`_repeat_runs`; where a block's allocations outlive its run
  into the next block's, those copies pile up); the grown sizes grow.

Blocks alike, the alignment may take the new block's allocations from two neighbouring blocks
(the tail of one, the head of the next), and a copy then comes in another order than the real
block's. The drawing is therefore checked as the lines of the peak are (:func:`drawn_to`): the
trace at ``n + 2`` blocks drawn from ``n`` and ``n + 1``, replayed, must add to its tensors'
peak what the one faked at ``n + 2`` adds (rounding and cache, within :data:`CHECK_REL`; the
tensors' peak itself is the composed plan's, from the lines and the analytic states); whole
blocks are repeated only where one block deeper they make the faked trace's events exactly.
Runs repeated in place for two blocks or more are checked two blocks deeper as well, against a
fake one block deeper than the third: their piled-up copies grow with each block. Where the
order faked does not repeat block after block but does with each run of frees in one order
(DDP: autograd frees a block's small tensors in another rotation at each depth), whole blocks
are drawn in that order once they make that deeper fake's trace event for event (asked for too
where the runs fail their first check). Where every check fails, or the traces do not align,
the caller keeps the share of the peak (:func:`sharded_exp.plan.depth.compose_allocator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
    shallow: list | None = None
    """The shallower trace's events (what :attr:`periods` inserts blocks into)."""
    periods: list[tuple[int, int]] | None = None
    """Where the deeper trace is the shallow one with whole blocks inserted: each ``(start,
    end)`` a window of events that, ids and grown sizes aside, the shallow trace has not got
    and the window just before repeats (:func:`_periods`); None where it is not so."""
    matched: dict[int, int] | None = None
    """The deeper trace's allocations (event index) -> the shallow trace's they stand for."""


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
        if kb[j][1] > ka[i][1]:  # smaller one block deeper: another tensor in its place, held
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
    return Step(list(deep), new, grown, list(shallow), _block_windows(shallow, deep, grown), match)


def _block_windows(shallow: list, deep: list, grown: dict[int, int]) -> list[tuple[int, int]] | None:
    """:attr:`Step.periods` of ``deep`` over ``shallow``, its ``grown`` sizes as in the shallow trace."""
    shrunk = [(op, i, size - grown.get(j, 0), st) for j, (op, i, size, st) in enumerate(deep)]
    periods = _periods(_keys(shallow), _keys(shrunk))
    if periods and any(s <= j < e for j in grown for s, e in periods):
        return None  # a grown allocation inside a block: its copies would grow too
    return periods


def _grown_on_lines(first: Step, then: Step) -> None:
    """Keep of two steps' grown allocations (``first`` from depth n to n + 1, ``then`` from
    n + 1 to n + 2) those that grow by the same bytes in both, as a bucket or a tensor of one
    element per parameter does; elsewhere the size changed because the faked rank steps other
    tensors at each depth (whole tensors dealt out: ZeRO-1, OSS), one in another's place, and
    a drawing that grew it with each block would draw a tensor no depth has (at 24 blocks
    from 2 and 3, 21 x 128 KiB where each is 192 or 256 KiB): its size is held."""
    same = {j for j, g in then.grown.items() if first.grown.get(then.matched.get(j)) == g}
    kept = {then.matched[j] for j in same}
    for step, keep in ((first, kept), (then, same)):
        if set(step.grown) != keep:
            step.grown = {j: g for j, g in step.grown.items() if j in keep}
            step.periods = _block_windows(step.shallow, step.events, step.grown)


def _periods(ka: list, kb: list) -> list[tuple[int, int]] | None:
    """The windows of ``kb`` (the deeper trace's events as the allocator sees them, grown sizes
    as in the shallow one) that make it ``ka`` with whole blocks inserted, one window in each
    stretch of repeated events (the forward's blocks, the backward's, the optimizer's): where
    the two traces part, the shortest window that repeats the window of its length just before
    it and after which the traces go on together (as far as the window is long, else for one
    event). Found in one
    pass, so the window sits at the end of its stretch, one block's events from where the
    previous window of the same events begins (not a shortest edit script, which may split a
    block's events around a neighbour's where blocks are alike). None where no such windows
    make ``kb`` from ``ka``."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while j < len(kb):
        if i < len(ka) and ka[i] == kb[j]:
            i, j = i + 1, j + 1
            continue
        tandem = [n for n in range(1, min(j, len(kb) - j - (len(ka) - i)) + 1) if kb[j - n : j] == kb[j : j + n]]
        # the traces go on together a window's length after it (or, where the next stretch's
        # window comes sooner, one event)
        length = next((n for n in tandem if kb[j + n : j + n + min(n, len(ka) - i)] == ka[i : i + n]), None)
        if length is None:
            length = next((n for n in tandem if kb[j + n : j + n + 1] == ka[i : i + 1]), None)
        if length is None:
            return None
        if (
            out
            and out[-1][1] == j
            and kb[out[-1][0] - (j + length - out[-1][0]) : out[-1][0]] == kb[out[-1][0] : j + length]
        ):
            out[-1] = (out[-1][0], j + length)  # one block whose events repeat within it (two kinds alternating)
        else:
            out.append((j, j + length))
        j += length
    return out if out and i == len(ka) else None


def deepen(step: Step, blocks: int) -> list:
    """The trace with ``blocks`` more blocks than ``step``'s deeper trace, the grown sizes grown:
    each block window repeated after itself (:func:`_repeat_periods`) where the deeper trace is
    the shallow one with whole blocks inserted; else each run of the new block's events repeated
    right after itself (:func:`_repeat_runs`)."""
    if blocks < 0:
        raise ValueError(f"a trace is deepened by 0 or more blocks, not {blocks}")
    drawn = _repeat_periods(step, blocks) if step.periods else None
    return drawn if drawn is not None else _repeat_runs(step, blocks)


class _Successors:
    """Which allocation of a trace follows which, one block on (:func:`_repeat_periods`): where a
    stretch of events repeats block after block, an allocation's successor is the allocation a
    window's length later; a window's own allocations' successors are their copies; an
    allocation made before the stretch is followed by what the same free, a window's length
    away, frees, whichever of the two was made later (both made before the trace: the later
    free's)."""

    def __init__(self, step: Step):
        events = step.events
        keys = _keys([(op, i, size - step.grown.get(j, 0), st) for j, (op, i, size, st) in enumerate(events)])
        self.own: set = set()  # allocations made in a window
        self.next: dict = {}
        self.inside = [False] * len(events)
        stretches = []  # (first event, window length, window start): where the events repeat
        for start, end in step.periods or []:
            length = end - start
            for q in range(start, end):
                self.inside[q] = True
                if events[q][0] == "malloc":
                    self.own.add(events[q][1])
            q = start - 1
            while q >= 0 and keys[q] == keys[q + length]:
                if events[q][0] == "malloc":
                    self.next[events[q][1]] = events[q + length][1]
                q -= 1
            stretches.append((q + 1, length, start))
        # an allocation made before its stretch (the unit gathered before the first block runs, the
        # embedding's output that the first block's backward frees): where an event and the same
        # event a window later refer to two allocations, the one made later is the other's
        # successor, where none precedes that. A forward's stretch runs from block to block, so
        # that is the later event's; a backward's runs back, so it is the earlier event's. (Two
        # allocations made before the trace: the later event's, as for a forward.)
        made = {e[1]: q for q, e in enumerate(events) if e[0] == "malloc"}
        taken = set(self.next.values())
        for first, length, start in stretches:
            for q in range(first, start):
                op, ident = events[q][:2]
                after = events[q + length][1]
                if op not in ("free", "record_stream") or ident == after:
                    continue
                early, late = sorted((ident, after), key=lambda i: made.get(i, -1))
                if early not in self.next and late not in taken:
                    self.next[early] = late
                    taken.add(late)

    def later(self, ident, k: int):
        """The allocation ``k`` successors on from ``ident`` (a window's copy: ``(ident, k)``)."""
        while k > 0 and ident not in self.own and ident in self.next:
            ident, k = self.next[ident], k - 1
        return (ident, k) if k > 0 and ident in self.own else ident


def _repeat_periods(step: Step, blocks: int) -> list | None:
    """Each window of :attr:`Step.periods` repeated ``blocks`` times right after itself, each
    event referring to the allocation it refers to in the trace ``blocks`` blocks deeper.

    Where a stretch of events repeats (block after block), an allocation's *successor* is the
    allocation a window's length later, and the window's own allocations' successors are their
    copies, one per copy in order. What an event refers to follows from how it moved one block
    deeper:

    - outside the windows, each event is one of the shallow trace's: where it refers to the
      successor of what it referred to there (FSDP2's last gathered unit, freed after the last
      block; the backward freeing the blocks' activations from the deepest), it refers to the
      allocation ``blocks`` successors on; where it refers to the same one, to that one;
    - in a window, each event compared with the one a window's length before it: referring to
      the successor of what that one refers to (a block's own allocations, and the unit the
      block before gathered ahead and this one frees), copy ``k`` refers to the allocation ``k``
      successors on; referring to its predecessor (a backward undoing the forward's blocks from
      the deepest), the window refers to the one ``blocks`` on and copy ``k`` to ``blocks - k``.

    None where an event fits neither, or the result frees what it has not allocated."""
    events, after = step.events, _Successors(step)
    # how many blocks on each event of the deeper trace refers: 0 or ``blocks``
    shift = [0] * len(events)
    same: dict = {}  # shallow allocation -> the deeper trace's, by the alignment
    outside = iter(j for j in range(len(events)) if not after.inside[j])
    for (_, ident_a, _, _), j in zip(step.shallow, outside):
        op, ident = events[j][:2]
        if op == "malloc":
            same[ident_a] = ident
        elif op in ("free", "record_stream") and ident != same.get(ident_a, ident_a):
            if after.next.get(same.get(ident_a)) != ident:
                return None
            shift[j] = blocks
    on: dict[int, int] = {}  # window event -> +1: copy k refers k on; -1: blocks - k on
    for start, end in step.periods or []:
        for q in range(start, end):
            op, ident = events[q][:2]
            before = events[q - (end - start)][1]
            if op == "malloc" or (op != "sync" and ident != before and after.next.get(before) == ident):
                on[q] = 1
            elif op != "sync" and ident != before:
                if after.next.get(ident) != before:
                    return None
                on[q], shift[q] = -1, blocks
    ends = {end: start for start, end in step.periods or []}
    out: list = []
    for index, (op, ident, size, stream) in enumerate(events):
        if op != "malloc" and shift[index]:
            ident = after.later(ident, shift[index])
        out.append((op, ident, size + blocks * step.grown.get(index, 0), stream))
        for k in range(1, blocks + 1) if index + 1 in ends else ():
            for q in range(ends[index + 1], index + 1):
                e, step_on = events[q], on.get(q, 0)
                copy_k = k if step_on == 1 else blocks - k if step_on == -1 else 0
                out.append((e[0], after.later(e[1], copy_k) if copy_k else e[1], e[2], e[3]))
    return out if _consistent(out) else None


def _consistent(events: list) -> bool:
    """Whether each allocation is made once and every free and use is of a live one."""
    live: set = set()
    made: set = set()
    for op, ident, _, _ in events:
        if op == "malloc":
            if ident in made:
                return False
            made.add(ident)
            live.add(ident)
        elif op == "free":
            if ident not in live:
                return False
            live.discard(ident)
        elif op == "record_stream" and ident not in live:
            return False
    return True


def _repeat_runs(step: Step, blocks: int) -> list:
    """Each run of the new block's events repeated ``blocks`` more times right after itself (each
    copy with its own allocations). Where a block's events straddle its end (an allocation of one
    block freed in the next's run), the copies of it pile up."""
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
DDP's and ZeRO-1's drawings are within 1-2%; FSDP2's was 9% while each run was repeated in
place (its prefetched units piled up), 0% drawn as whole blocks."""


def same_trace(a: tuple | None, b: tuple | None) -> bool:
    """Whether two fakes' traces (events, allocator setting, workspace) ask the allocator for
    the same: the same events in the same order, whatever their ids, but for the order of frees
    that follow one another (:func:`_frees_in_one_order`)."""
    return (
        a is not None
        and b is not None
        and a[1:] == b[1:]
        and _keys(_frees_in_one_order(a[0])) == _keys(_frees_in_one_order(b[0]))
    )


def _frees_in_one_order(events: list) -> list:
    """``events`` with each run of frees (no other event between them) in the order their
    allocations were made. The allocator ends such a run in one state whatever its order: a
    freed block merges with the free blocks beside it in its segment, whichever was freed first,
    and a free delayed by a stream's use waits for that stream's work, then is freed the same
    way (only the peak count of inactive split blocks in between may differ, which no figure
    of a point reads). The order itself may follow Python's: autograd's graph, released after the loss's
    backward, freed four small tensors in one rotation at 8 ranks and another at 64 (DDP, ZeRO-1
    on a 7B GPT cut to a block). For comparing traces (:func:`same_trace`), and for a drawing
    only where the order faked does not repeat block after block
    (:func:`_whole_blocks_in_one_order`): elsewhere a drawing follows the order faked, which says
    where a block's events begin and end."""
    made = {e[1]: q for q, e in enumerate(events) if e[0] == "malloc"}
    out: list = []
    run: list = []
    for event in [*events, None]:
        if event is not None and event[0] == "free":
            run.append(event)
            continue
        out += sorted(run, key=lambda e: made.get(e[1], -1))
        out += [event] if event is not None else []
        run = []
    return out


def aligns(a: list, b: list, c: list) -> bool:
    """Whether of three traces one block apart, one at least is another's with a block's events
    inserted (:func:`block_step`). Where neither is, faking deeper does not make them so (ShardedDDP:
    its synchronisations and frees move between depths, at every depth of a 7B GPT from 1 to 5)."""
    a, b, c = _steps_only(a), _steps_only(b), _steps_only(c)
    return block_step(a, b) is not None or block_step(b, c) is not None


def _steps_only(events: list) -> list:
    """``events`` up to the last step's end, where what follows frees only: the fake step's
    teardown, which no peak sees and whose order follows Python's garbage collector (a few
    small tensors freed there in one process and not in another would keep two depths'
    traces from aligning)."""
    ends = [i for i, e in enumerate(events) if e[0] == "sync"]
    if not ends or any(e[0] != "free" for e in events[ends[-1] + 1 :]):
        return events
    return events[: ends[-1] + 1]


def drawn_to(
    a: list,
    b: list,
    c: list,
    blocks: int,
    alloc_conf: str | None = None,
    deeper: Callable[[], list | None] | None = None,
) -> list | None:
    """The trace ``blocks`` blocks deeper than ``c``, where ``a``, ``b`` and ``c`` are the traces
    of the same model at three depths one block apart: drawn from ``b`` and ``c``, once the
    trace drawn from ``a`` and ``b`` adds to its tensors' peak what ``c``'s replay does
    (:data:`CHECK_REL`); None where the traces do not repeat so. Where ``c`` is no block step
    from ``b`` (a strategy that deals whole tensors to ranks fakes its largest rank, which at
    2 ranks may be the other one at every other depth, holding other tensors' optimizer
    state), the drawing just checked is drawn on from ``a`` and ``b``.

    Drawn by runs in place (not whole blocks), a block's allocations that outlive its run pile
    up, one more with each copy, so one copy may pass where many do not (fsdp_grad_op on a 7B
    GPT at 8 ranks, drawn by runs before :class:`_Successors` read its first block's successors
    from its backward: the drawing from 3 and 4 blocks within 2 MiB of 5 blocks' cache, 2,964
    MiB over 6 blocks', 55 GiB reserved at 32 blocks against 38 faked whole). Such a drawing of two
    copies or more is checked two blocks on as well, against ``deeper()``, the trace one block
    deeper than ``c``; None where that cannot be had. A heuristic still: a pile-up of under
    half the check's bound per copy passes both. Where whole blocks made ``c`` one block on,
    the drawing is of whole blocks or none (never runs in place unchecked). Wherever
    ``deeper()`` is asked (two copies or more by runs, or runs that fail the first check), whole
    blocks with each run of frees in one order are tried first, and drawn where one copy makes
    that trace event for event (:func:`_whole_blocks_in_one_order`), whatever the first check
    said."""
    a, b, c = _steps_only(a), _steps_only(b), _steps_only(c)
    first, step = block_step(a, b), block_step(b, c)
    if first is None:
        return None
    if step is not None:
        _grown_on_lines(first, step)
    # whole blocks repeated where they make the third trace's events one block deeper; else runs
    periodic = first.periods is not None and _keys(_repeat_periods(first, 1) or []) == _keys(c)
    if not periodic:
        first.periods = None
    checked = _adds_as(replay(deepen(first, 1), alloc_conf), replay(c, alloc_conf))
    # drawn on from b and c; where c is no block step from b (the faked rank's tensors moved
    # from b to c), the drawing just checked, from a and b
    final, copies = (first, blocks + 1) if step is None else (step, blocks)
    if periodic:
        return _repeat_periods(final, copies) if checked and final.periods else None
    if copies > 1 or not checked:  # runs in place: whole blocks with the frees in one order, else checked on
        d = deeper() if deeper is not None else None
        whole = _whole_blocks_in_one_order(a, b, c, d, blocks) if d is not None else None
        if whole is not None:
            return whole
        if not checked or d is None:
            return None
        if not _adds_as(replay(deepen(first, 2), alloc_conf), replay(_steps_only(d), alloc_conf)):
            return None
    return _repeat_runs(final, copies)


def _whole_blocks_in_one_order(a: list, b: list, c: list, d: list, blocks: int) -> list | None:
    """The trace ``blocks`` blocks deeper than ``c``, drawn as whole blocks from ``b`` and ``c``
    with each run of frees in one order (:func:`_frees_in_one_order`), where that drawing makes
    ``d`` (one block deeper than ``c``) event for event in that order; else None. A trace whose
    blocks free in another order each (DDP: autograd's graph released in another rotation)
    repeats block after block only so; where the order faked does repeat (FSDP2), the drawing
    keeps it (:func:`drawn_to`), since reordered its blocks' events no longer begin and end
    where a block's do."""
    a, b, c, d = (_frees_in_one_order(_steps_only(t)) for t in (a, b, c, d))
    first, step = block_step(a, b), block_step(b, c)
    if first is None or step is None:
        return None
    _grown_on_lines(first, step)
    one = _repeat_periods(step, 1) if step.periods else None
    if one is None or _keys(_frees_in_one_order(one)) != _keys(d):
        return None
    return _repeat_periods(step, blocks)


def _adds_as(drawn, faked) -> bool:
    """Whether a drawn trace's replay adds to its tensors' peak (rounding, cache) what the faked
    one's does, within :data:`CHECK_REL` of the faked reserved peak: what rides on the composed
    peak is what the replay adds beyond the tensors'."""
    for name in ("allocated_mib", "reserved_mib"):
        extra = getattr(drawn, name) - drawn.tracked_peak_mib - (getattr(faked, name) - faked.tracked_peak_mib)
        if abs(extra) > CHECK_REL * faked.reserved_mib:
            return False
    return True
