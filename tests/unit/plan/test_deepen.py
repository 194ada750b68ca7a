"""sharded_exp/plan/deepen.py: a deep model's allocation trace drawn from shallow ones.

The traces are made up (:mod:`tests.helpers.traces`): a stack of identical blocks whose forward keeps
one activation per block and whose backward frees them in reverse, with a bucket that grows
with the depth (``model_trace``), or whose units are gathered a block ahead (``prefetch_trace``).
Drawn from two depths, the trace at any depth must be the one made up there.
"""

from __future__ import annotations

import pytest

from sharded_exp.plan.deepen import _keys, _repeat_periods, aligns, block_step, deepen, drawn_to, same_trace
from sharded_exp.predict.alloc_trace import replay
from tests.helpers.traces import (
    MIB,
    alternating_trace,
    dealt_trace,
    embedded_trace,
    model_trace,
    paired_trace,
    piled_trace,
    prefetch_trace,
    renumbered,
    rotated_trace,
)


def test_a_trace_drawn_from_two_depths_is_the_deeper_models():
    """2 -> 3 blocks adds a weight, a forward block (3 events), an activation freed, an optimizer
    temporary made and freed, and 1 MiB to the bucket: 7 new events, 1 grown. Repeated 3 more
    times, as whole blocks or each run in place (nothing here outlives its block's run but what
    the backward or the optimizer frees), they make the 6-block model's trace event for event
    (ids aside)."""
    step = block_step(model_trace(2), model_trace(3))
    assert sum(step.new) == 7
    assert list(step.grown.values()) == [MIB]
    assert step.periods is not None
    for periods in (step.periods, None):  # whole blocks, then (none found) each run in place
        step.periods = periods
        drawn = deepen(step, 3)
        assert _keys(drawn) == _keys(model_trace(6))
        assert replay(drawn) == replay(model_trace(6))
        assert deepen(step, 0) == model_trace(3)


def test_a_block_gathered_ahead_is_drawn_a_block_apart_not_stacked():
    """Each unit is gathered (8 MiB, on its own stream) inside the block before's run and freed
    inside the next block's, so at most two gathered units are live at any depth: one 20 MiB
    segment on the gather stream (8 MiB is a large request under 10 MiB: a 20 MiB segment, split),
    42 MiB reserved in all with the default stream's 20 MiB segment (the 2 MiB activations) and
    2 MiB small segment (the 1 MiB temporaries). Drawn from 3 and 4 blocks to 8, each copy's
    unit must be freed inside the next copy's run; copies placed each right after its own run
    hold all five drawn units at once: three segments on that stream, 82 MiB."""
    drawn = deepen(block_step(prefetch_trace(3), prefetch_trace(4)), 4)
    assert _keys(drawn) == _keys(prefetch_trace(8))
    assert replay(drawn) == replay(prefetch_trace(8))
    assert replay(drawn).reserved_mib == 42
    assert replay(drawn_to(prefetch_trace(3), prefetch_trace(4), prefetch_trace(5), 3)) == replay(prefetch_trace(8))


def test_a_block_whose_events_repeat_within_it_is_one_window():
    """3 -> 4 blocks adds two allocations (events 6 and 7) and their frees (14 and 15, the second
    first). One event already repeats the one before it, but a window one event long would
    take the first tensor of a block for the successor of the second; two such windows side by
    side are one block's. Drawn to 7 blocks, each tensor is freed where the 7-block trace frees it."""
    step = block_step(paired_trace(3), paired_trace(4))
    assert step.periods == [(6, 8), (14, 16)]
    assert renumbered(_repeat_periods(step, 3)) == paired_trace(7)


def test_a_first_block_unlike_the_others_still_has_its_successors():
    """The embedding's output is made three events before the first block's, where each block's
    output is made two before the next block's; the first block frees the embedding's 6 MiB unit
    where each later block frees the block before's 4 MiB one. So the forward's stretch of
    repeated events ends inside the first block, and by position the embedding's output has no
    successor. The first block's backward frees it where each later block's backward frees the
    output of the block before: that free, a window's length apart in the backward, says which
    allocation follows which, and the one made later is the successor (the backward runs from
    the deepest block back). Drawn so from 2 and 3 blocks, the trace at 6 blocks is the 6-block
    model's; drawn on from 4 blocks to 8, it replays as the 8-block trace does."""
    step = block_step(embedded_trace(2), embedded_trace(3))
    assert step.periods is not None
    assert renumbered(_repeat_periods(step, 3)) == embedded_trace(6)
    drawn = drawn_to(embedded_trace(2), embedded_trace(3), embedded_trace(4), 4)
    assert _keys(drawn) == _keys(embedded_trace(8))
    assert replay(drawn) == replay(embedded_trace(8))


def test_whole_blocks_are_repeated_only_where_they_make_the_third_trace():
    """From 1 and 2 blocks the gathered units' stretch is too short to say which unit follows
    which (the first unit is gathered before any block runs): the blocks repeated do not make the
    3-block trace, so the drawing falls back to the runs in place, whose piled-up units fail the
    check one block deeper (reserved 62 MiB against 42): nothing is drawn."""
    step = block_step(prefetch_trace(1), prefetch_trace(2))
    assert _keys(deepen(step, 1)) != _keys(prefetch_trace(3))
    assert drawn_to(prefetch_trace(1), prefetch_trace(2), prefetch_trace(3), 1) is None  # one copy: the first check


def test_a_trace_that_drops_an_allocation_is_no_block_step():
    """The shallow trace allocates on a stream the deeper one never uses: nothing grew into it."""
    odd = model_trace(2) + [("malloc", "odd", MIB, "side")]
    assert block_step(odd, model_trace(3)) is None


def test_drawn_to_checks_the_drawing_one_block_deeper():
    """Drawn from 2 and 3 blocks, the 4-block trace replays like the one given as 4 blocks, so
    the 7-block trace is drawn from 3 and 4; given the 6-block trace as the third (two blocks
    more: its peaks far past the check's 2% from the 4-block drawing), nothing is drawn."""
    a, b, c = model_trace(2), model_trace(3), model_trace(4)
    assert _keys(drawn_to(a, b, c, 3)) == _keys(model_trace(7))
    assert drawn_to(a, b, model_trace(6), 1) is None  # one copy: the first check fails
    with pytest.raises(ValueError, match="0 or more blocks, not -1"):
        deepen(block_step(a, b), -1)


def test_what_a_fake_frees_after_its_last_step_is_not_drawn():
    """The shallowest fake freed its first weight after the step (Python's garbage collector
    ran there, not in the others): the deeper trace is then no longer the shallow one with
    whole blocks inserted. Frees after the last step's end change no peak, so the traces are
    drawn without them."""
    torn_down = model_trace(2) + [("free", 0, 0, None)]
    assert block_step(torn_down, model_trace(3)).periods is None
    assert _keys(drawn_to(torn_down, model_trace(3), model_trace(4), 3)) == _keys(model_trace(7))


def test_two_traces_are_the_same_whatever_their_ids():
    renamed = [(op, None if i is None else ("x", i), size, s) for op, i, size, s in model_trace(3)]
    assert same_trace((model_trace(3), "", 0.0), (renamed, "", 0.0))
    assert not same_trace((model_trace(3), "", 0.0), (model_trace(3), "expandable_segments:True", 0.0))
    assert not same_trace((model_trace(3), "", 0.0), (model_trace(4), "", 0.0))
    assert not same_trace(None, (model_trace(3), "", 0.0))


def test_two_traces_that_free_in_another_order_ask_the_same():
    """model_trace frees the last block's temporary and then its blocks' activations one after
    another: that run of four frees the other way round asks the allocator for the same (each
    freed block merges with its free neighbours whichever goes first), so the two traces are the
    same and replay alike. The run's last free moved past the allocation after it is another
    trace."""
    trace = model_trace(3)
    first = next(q for q, e in enumerate(trace) if e[0] == "free" and trace[q + 1][0] == "free")
    assert [e[0] for e in trace[first : first + 5]] == ["free"] * 4 + ["malloc"]
    turned = trace[:first] + trace[first : first + 4][::-1] + trace[first + 4 :]
    assert turned != trace and same_trace((trace, "", 0.0), (turned, "", 0.0))
    assert replay(turned) == replay(trace)
    moved = trace[: first + 3] + [trace[first + 4], trace[first + 3]] + trace[first + 5 :]
    assert not same_trace((trace, "", 0.0), (moved, "", 0.0))


def test_blocks_that_free_in_another_order_each_are_drawn_as_whole_blocks_in_one_order():
    """rotated_trace frees the last temporary and the activations after the forward in another
    rotation at each depth: in the order faked no window of the 3-block trace repeats the one
    before it, so each run of the new block's events would be repeated in place, which the
    4-block trace refuses. With each run of frees in the order its allocations were made, whole
    blocks drawn from 3 and 4 blocks make the 5-block trace event for event, and are drawn on:
    to 9 blocks, the 9-block trace in that order, replayed alike. Given a 5-block trace that
    does not match so, or none, nothing is drawn."""
    from sharded_exp.plan.deepen import _frees_in_one_order

    t = {n: rotated_trace(n) for n in range(2, 10)}
    one_order = _keys(_frees_in_one_order(model_trace(3)))
    assert _keys(t[3]) != _keys(model_trace(3)) and _keys(_frees_in_one_order(t[3])) == one_order
    drawn = drawn_to(t[2], t[3], t[4], 5, deeper=lambda: t[5])
    assert _keys(drawn) == _keys(_frees_in_one_order(t[9]))
    assert replay(drawn) == replay(t[9])
    other = t[5][:-1] + [("malloc", "x", 512, "default"), ("free", "x", 0, None), t[5][-1]]
    assert drawn_to(t[2], t[3], t[4], 5, deeper=lambda: other) is None
    assert drawn_to(t[2], t[3], t[4], 5) is None


def test_three_traces_align_where_one_is_another_with_a_block_inserted():
    """The made-up 2-block trace allocates on a stream the deeper ones never use: 2 -> 3 is no block
    step, 3 -> 4 is. A trace whose every depth allocates on another stream of its own aligns at
    no two depths."""
    odd = model_trace(2) + [("malloc", "odd", MIB, "side")]
    assert aligns(odd, model_trace(3), model_trace(4))
    own = [model_trace(n) + [("malloc", "odd", MIB, f"side {n}")] for n in (2, 3, 4)]
    assert not aligns(*own)


def test_an_allocation_grows_with_depth_only_on_a_line():
    """The made-up rank's dealt temporary is 192 KiB at 2 blocks, 256 KiB at 3, 192 KiB at 4:
    one step alone takes it for one grown by 64 KiB a block (2 -> 3; 3 -> 4 would shrink it), and
    drawn from 2 and 3 to 7 blocks it would be 512 KiB, a size no depth has. The bucket grows 1
    MiB from 2 to 3 and from 3 to 4: on a line, it keeps growing. So drawn from 2, 3 and 4, the
    temporary is held at 4 blocks' 192 KiB and the bucket is the 7-block trace's."""
    step = block_step(dealt_trace(2), dealt_trace(3))
    assert sorted(step.grown.values()) == [64 * 1024, MIB]
    assert [e[2] for e in deepen(step, 4) if e[1] == "dealt"][0] == 512 * 1024
    assert sorted(block_step(dealt_trace(3), dealt_trace(4)).grown.values()) == [MIB]  # nothing shrinks
    drawn = drawn_to(dealt_trace(2), dealt_trace(3), dealt_trace(4), 3, deeper=lambda: dealt_trace(5))
    assert [e[2] for e in drawn if e[1] == "dealt"] == [192 * 1024, 0]
    assert min(e[2] for e in drawn if e[0] == "malloc") > 0
    bucket = [e for e in model_trace(7) if e[0] == "malloc"][-1][2]
    assert [e for e in drawn if e[0] == "malloc"][-1][2] == bucket


def test_where_the_third_depth_is_no_block_step_the_checked_drawing_is_drawn_on():
    """4 -> 5 blocks drops the even depth's state (no block step): what is drawn to 7 blocks
    is the drawing from 3 and 4 that the check has just held against 5 (its state's copies
    share one small segment of their stream: the same reserved memory as one)."""
    a, b, c = alternating_trace(3), alternating_trace(4), alternating_trace(5)
    assert block_step(b, c) is None
    drawn = drawn_to(a, b, c, 2, deeper=lambda: alternating_trace(6))
    assert drawn == deepen(block_step(a, b), 3)
    assert _keys([e for e in drawn if e[3] != "side"]) == _keys(model_trace(7))


def test_a_drawing_by_runs_is_checked_two_blocks_on():
    """From 1 and 2 blocks the units' stretch is too short for whole blocks: each run is repeated
    in place, and each copy keeps its unit to the end of the forward, one 12 MiB segment more per
    copy. One copy passes the check against 3 blocks (336 MiB reserved against 324: within 5%),
    two do not against a 4-block trace (348 against 326, here with a 512-byte tensor more, made
    and freed before the step's end, so that nothing else matches it), so no drawing of two
    blocks or more is made from 1, 2 and 3, nor without the trace one block deeper to check it
    on. Given the 4-block trace itself, whole blocks drawn from 2 and 3 make it event for event
    (:func:`_whole_blocks_in_one_order`) and are drawn on: the 6-block trace. From 2, 3 and 4,
    whole blocks make the 5-block trace and are drawn without it."""
    t = {n: piled_trace(n) for n in range(1, 8)}
    other = t[4][:-1] + [("malloc", "x", 512, "default"), ("free", "x", 0, None), t[4][-1]]
    assert drawn_to(t[1], t[2], t[3], 1) is not None  # one copy: what the check has just held
    assert drawn_to(t[1], t[2], t[3], 3, deeper=lambda: other) is None
    assert drawn_to(t[1], t[2], t[3], 3) is None
    assert drawn_to(t[1], t[2], t[3], 3, deeper=lambda: None) is None
    assert _keys(drawn_to(t[1], t[2], t[3], 3, deeper=lambda: t[4])) == _keys(t[6])

    def no_deeper():
        raise AssertionError("whole blocks are checked on the third trace alone")

    assert _keys(drawn_to(t[2], t[3], t[4], 3, deeper=no_deeper)) == _keys(t[7])
    assert replay(t[7]).reserved_mib == 324
