"""sharded_exp.predict.alloc_trace: the events recorded from a memory tracker (allocations
on the stream entered, frees, collectives' tensors on NCCL's stream, step ends), a fake CUDA
step's trace, the replay's figures worked by hand, and the CUDA context's choice."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed._tools.mem_tracker import _UpdateType

from sharded_exp.predict.alloc_trace import (
    DEFAULT_STREAM,
    NCCL_STREAM,
    AllocTrace,
    cuda_context,
    recording,
    replay,
)
from sharded_exp.predict.allocator import cuda_context_entries

MIB = 2**20


class StubTracker:
    """What AllocTrace reads of torch's MemTracker: ``_update_snap`` and ``_WINFO``."""

    def __init__(self):
        self.calls = []
        self._WINFO = {}

    def _update_snap(self, u_type, winfo, *args, **kwargs):
        self.calls.append(u_type)


def test_a_trace_records_allocations_on_the_stream_entered_and_frees_in_order():
    trace = AllocTrace(side_streams=("copy-in",))
    tracker = StubTracker()
    trace.attach(tracker)
    a, b = SimpleNamespace(mem_consumed=100), SimpleNamespace(mem_consumed=300)
    with trace.streams(torch.cpu):
        tracker._update_snap(_UpdateType.ADD, a)
        with torch.cpu.stream(torch.cpu.Stream()):
            tracker._update_snap(_UpdateType.ADD, b)
        tracker._update_snap(_UpdateType.DEL, a)
        tracker._update_snap(_UpdateType.REF, b)  # recategorised: no event
    trace.step_end()
    assert trace.events == [
        ("malloc", 0, 100, DEFAULT_STREAM),
        ("malloc", 1, 300, "copy-in"),
        ("free", 0, 0, None),
        ("sync", None, 0, None),
    ]
    assert tracker.calls == [_UpdateType.ADD, _UpdateType.ADD, _UpdateType.DEL, _UpdateType.REF]  # passed on
    assert torch.cpu.stream.__module__ == "torch.cpu"  # restored


def test_a_resized_storage_is_a_free_and_a_new_block_and_a_restart_keeps_what_is_live():
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 and gathers it again
    by resizing it back: to the allocator, a free and a new block each time."""
    trace = AllocTrace()
    tracker = StubTracker()
    trace.attach(tracker)
    kept, unit = SimpleNamespace(mem_consumed=10), SimpleNamespace(mem_consumed=400)
    tracker._update_snap(_UpdateType.ADD, kept)
    tracker._update_snap(_UpdateType.ADD, unit)
    unit.mem_consumed = 0
    tracker._update_snap(_UpdateType.SIZE, unit, old_mem_consumed=400)
    unit.mem_consumed = 400
    tracker._update_snap(_UpdateType.SIZE, unit, old_mem_consumed=0)
    assert trace.events[2:] == [("free", 1, 0, None), ("malloc", 2, 400, DEFAULT_STREAM)]
    trace.restart()  # the build is over: what is allocated now, in order
    assert trace.events == [("malloc", 0, 10, DEFAULT_STREAM), ("malloc", 2, 400, DEFAULT_STREAM)]
    tracker._update_snap(_UpdateType.DEL, unit)
    assert trace.events[-1] == ("free", 2, 0, None)


def test_a_restart_that_holds_frees_records_the_live_blocks_frees_when_released():
    """From a restart with ``hold_frees`` (a wrap that does not shard, AllocTrace.restart) to
    ``release_held``: a block then live and freed (a parameter fairscale OSS copied into its
    rank's buffer) is recorded as freed at the release, after the buffer; a block made and freed
    in between (a temporary of the wrap) at once; a block freed after the release at once."""
    trace = AllocTrace()
    tracker = StubTracker()
    trace.attach(tracker)
    first, second = SimpleNamespace(mem_consumed=100), SimpleNamespace(mem_consumed=200)
    for w in (first, second):
        tracker._update_snap(_UpdateType.ADD, w)
    trace.restart(hold_frees=True)
    buffer, temporary = SimpleNamespace(mem_consumed=300), SimpleNamespace(mem_consumed=50)
    tracker._update_snap(_UpdateType.ADD, buffer)
    tracker._update_snap(_UpdateType.DEL, first)  # held
    tracker._update_snap(_UpdateType.ADD, temporary)
    tracker._update_snap(_UpdateType.DEL, temporary)  # made in the wrap: not held
    trace.release_held()
    tracker._update_snap(_UpdateType.DEL, second)  # after the release
    assert trace.events == [
        ("malloc", 0, 100, DEFAULT_STREAM),
        ("malloc", 1, 200, DEFAULT_STREAM),
        ("malloc", 2, 300, DEFAULT_STREAM),
        ("malloc", 3, 50, DEFAULT_STREAM),
        ("free", 3, 0, None),
        ("free", 0, 0, None),
        ("free", 1, 0, None),
    ]
    trace.release_held()  # nothing held: nothing recorded
    assert len(trace.events) == 7


def test_a_side_stream_is_named_at_its_first_allocation_and_unnamed_ones_are_numbered():
    trace = AllocTrace(side_streams=("first",))
    tracker = StubTracker()
    trace.attach(tracker)
    quiet, s2, s3 = torch.cpu.Stream(), torch.cpu.Stream(), torch.cpu.Stream()
    with trace.streams(torch.cpu):
        with torch.cpu.stream(quiet):  # communicates only: takes no name
            pass
        for i, s in enumerate((s2, s3)):
            with torch.cpu.stream(s):
                tracker._update_snap(_UpdateType.ADD, SimpleNamespace(mem_consumed=1))
    assert [e[3] for e in trace.events] == ["first", "stream 2"]


def test_a_collectives_tensors_are_recorded_on_nccls_stream(monkeypatch):
    trace = AllocTrace()
    tracker = StubTracker()
    trace.attach(tracker)
    t = torch.zeros(4)
    winfo = SimpleNamespace(mem_consumed=16)
    tracker._update_snap(_UpdateType.ADD, winfo)
    tracker._WINFO[t.untyped_storage()] = (winfo, None)
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: calls.append(tensor))
    with trace.streams(torch.cpu):
        dist.all_reduce(t)
    assert calls == [t]
    assert trace.events[-1] == ("record_stream", 0, 0, NCCL_STREAM)
    assert dist.all_reduce.__name__ == "<lambda>"  # the function found on entry is put back


@pytest.mark.parametrize("strategy", ["oss", "ddp"])
def test_a_strategy_that_does_not_shard_starts_the_device_trace_at_its_wrap(tiny_job, strategy):
    """A run moves such a model to the device and then wraps it: what the wrap frees is in
    the trace. fairscale OSS makes each rank's parameters views of one flat buffer, so every
    parameter's first block is freed before the first step, after every allocation of the
    wrap (held to its end: the trace of a model a block deeper is then the shallower one's
    with a block inserted); DDP frees none."""
    from sharded_exp.predict.fake_step import fake_step
    from sharded_exp.strategies import STRATEGIES

    cfg = tiny_job.copy()
    cfg.strategy = OmegaConf.structured(STRATEGIES.config_class(strategy)())
    events = fake_step(cfg, 2, 0, "cuda", flops=False).extra["alloc_events"]  # OSS: a flat buffer per rank
    first_sync = events.index(("sync", None, 0, None))
    params = list(tiny_job_model(cfg).parameters())
    first = events[: len(params)]  # the model moved to the device: its parameters, in order
    assert [(e[0], e[2]) for e in first] == [("malloc", p.numel() * 4) for p in params]
    freed = {e[1] for e in events[:first_sync] if e[0] == "free"} & {e[1] for e in first}
    assert len(freed) == (len(params) if strategy == "oss" else 0)
    if freed:  # one run of frees, the buffers that replace them allocated before it
        at = [i for i, e in enumerate(events) if e[0] == "free" and e[1] in freed]
        assert at == list(range(at[0], at[0] + len(params)))
        buffers = [e[2] for e in events[: at[0]] if e[0] == "malloc"][-2:]  # a rank's each, just before
        assert sum(buffers) == sum(e[2] for e in first) and min(buffers) > 0


def tiny_job_model(cfg):
    from sharded_exp.models import build_model

    with torch.device("meta"):
        return build_model(cfg.model)


@pytest.mark.parametrize("old_freed_last", [False, True])
def test_a_reallocation_frees_the_old_block_once_and_keeps_the_new_ones(old_freed_last):
    """DDP's bucket rebuild as a fake step tells it: the old bucket freed before the new ones
    are allocated (or after, where gradients are views into it); when the fake step drops the
    old bucket later, nothing more is recorded."""
    from sharded_exp.measure.tracker import reallocated

    trace = AllocTrace()
    tracker = StubTracker()
    trace.attach(tracker)
    bucket, winfo = torch.zeros(8), SimpleNamespace(mem_consumed=32)
    tracker._update_snap(_UpdateType.ADD, winfo)
    tracker._WINFO[bucket.untyped_storage()] = (winfo, None)
    reallocated([bucket], [20, 12], old_freed_last)  # no trace watching: nothing
    assert trace.events == [("malloc", 0, 32, DEFAULT_STREAM)]
    with trace.streams(torch.cpu):
        reallocated([bucket], [20, 12], old_freed_last)
    told = [("malloc", 1, 20, DEFAULT_STREAM), ("malloc", 2, 12, DEFAULT_STREAM)]
    freed = [("free", 0, 0, None)]
    assert trace.events[1:] == (told + freed if old_freed_last else freed + told)
    tracker._update_snap(_UpdateType.DEL, winfo)
    assert len(trace.events) == 4
    trace.restart()
    assert trace.events == told  # what is live: the new blocks


def test_recording_is_none_on_cpu():
    with recording("cpu") as trace:
        assert trace is None


def test_replay_rounds_each_large_weight_to_its_2_mib_segment():
    """20 weights of 16,000,000 bytes (Linear(2000, 2000), the ZeroRedundancyOptimizer
    recipe): each is a multiple of 512, large (> 1 MiB) and >= 10 MiB, so its segment is
    the size rounded up to 2 MiB: 16 MiB; the 777,216 bytes left are under 1 MiB, so the
    block is not split and counts 16 MiB allocated. 20 x 16 MiB = 320 MiB (335.5 MB)
    allocated and reserved, against 305.2 MiB tracked; no fragmentation."""
    events = [("malloc", i, 16_000_000, DEFAULT_STREAM) for i in range(20)]
    figures = replay(events)
    assert figures.allocated_mib == 320
    assert figures.reserved_mib == 320
    assert figures.tracked_peak_mib == pytest.approx(20 * 16_000_000 / MIB)
    assert figures.fragmentation_mib == 0
    assert figures.segments == 20


def test_replay_keeps_a_freed_block_of_another_stream_out_of_reach():
    """A 4 MiB tensor on a side stream, freed, then 4 MiB asked on the default stream: the
    cached block is the side stream's (a 20 MiB segment: 1-10 MiB requests), so a second
    20 MiB segment is reserved. With the workspace (1 MiB, small pool, a 2 MiB segment)
    first: 42 MiB reserved; 4 + 1 MiB allocated at most."""
    events = [("malloc", 0, 4 * MIB, "side"), ("free", 0, 0, None), ("malloc", 1, 4 * MIB, DEFAULT_STREAM)]
    figures = replay(events, workspace_bytes=MIB)
    assert figures.reserved_mib == 42
    assert figures.allocated_mib == 5
    assert figures.streams == ("side", DEFAULT_STREAM)


def test_expandable_segments_map_pages_not_segments():
    """Three 11 MiB tensors. By default each (>= 10 MiB) gets its own segment, rounded to
    2 MiB: 3 x 12 = 36 MiB reserved. Under expandable_segments they lie end to end in one
    segment mapped in 20 MiB pages: 33 MiB needs 2 pages, 40 MiB reserved."""
    events = [("malloc", i, 11 * MIB, DEFAULT_STREAM) for i in range(3)]
    assert replay(events).reserved_mib == 36
    expandable = replay(events, "expandable_segments:True")
    assert expandable.reserved_mib == 40
    assert expandable.alloc_conf == "expandable_segments:True"


def test_cuda_context_prefers_the_device_and_torch_published_else_the_newest_torchs():
    entries = [e for e in cuda_context_entries() if e.get("context_bytes")]
    newest = cuda_context(torch_version="9.9")
    assert newest["matched"].startswith("none")
    assert newest["source"]
    first = entries[0]
    found = cuda_context(device_name=first["device"], torch_version=first["torch"])
    assert found["mib"] == first["context_bytes"] / MIB
    assert found["matched"] == "device and torch"


@pytest.mark.parametrize("strategy", ["ddp"])
def test_a_fake_cuda_step_records_two_steps_of_allocations(tiny_job, strategy):
    from sharded_exp.predict.fake_step import fake_step
    from sharded_exp.strategies import STRATEGIES

    cfg = tiny_job.copy()
    # buckets of 1 KB: the rebuild makes several of the one first bucket
    cfg.strategy = OmegaConf.structured(STRATEGIES.config_class(strategy)(bucket_cap_mb=0.001))
    events = fake_step(cfg, 2, 0, "cuda", flops=False).extra["alloc_events"]
    assert [e for e in events if e[0] == "sync"] == [("sync", None, 0, None)] * 2
    made = {e[1] for e in events if e[0] == "malloc"}
    assert {e[1] for e in events if e[0] == "free"} <= made
    assert fake_step(cfg, 2, 0, "cpu", flops=False).extra.get("alloc_events") is None
    # DDP's bucket rebuild between the steps: its one first bucket (made before the first
    # step) freed, and new blocks of the same bytes allocated right after it (strategies/ddp.py;
    # not told where it would be one bucket again, as big)
    first_sync = events.index(("sync", None, 0, None))
    size = {e[1]: e[2] for e in events if e[0] == "malloc"}
    before = {e[1] for e in events[:first_sync] if e[0] == "malloc"}
    rebuilt = []
    for i, (op, ident, _, _) in enumerate(events[first_sync:], first_sync):
        if op == "free" and ident in before:
            after = itertools.takewhile(lambda e: e[0] == "malloc", events[i + 1 :])
            sums = list(itertools.accumulate(e[2] for e in after))
            if size[ident] in sums:  # the blocks right after it hold its bytes exactly
                rebuilt.append((size[ident], sums.index(size[ident]) + 1))
    assert len(rebuilt) == 1 and rebuilt[0][1] > 1, rebuilt


def test_a_finished_trace_takes_no_more_events():
    """A fake step's tensors kept by reference cycles die when Python's garbage collector
    gets to them, after the step: their frees must not be appended to the trace the planner
    kept (54 of a 1-block DDP GPT's 548 events were, at whatever moment the collector ran).
    Worked: one block allocated while recording, freed after the recording ended: one event."""
    tracker = StubTracker()
    with recording("cuda") as trace:
        trace.attach(tracker)
        tracker._update_snap(_UpdateType.ADD, SimpleNamespace(mem_consumed=512))
    kept = trace.events[0]
    tracker._update_snap(_UpdateType.DEL, kept and SimpleNamespace(mem_consumed=512, alloc_trace_id=kept[1]))
    assert trace.events == [("malloc", 0, 512, DEFAULT_STREAM)] and trace.closed
    assert tracker.calls == [_UpdateType.ADD, _UpdateType.DEL]  # the tracker itself is still told


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_fake_steps_trace_ends_with_its_second_step(tiny_job, strategy):
    """The trace a fake step returns is final and ends where its second step does: the model
    and optimizer, dropped after the step (by reference count, or later with their cycles by
    Python's garbage collector), are not appended to it as frees (before: 54 frees after a
    1-block DDP GPT's second step, 51 after FSDP's; the planner keeps traces and compares
    them, and one that grew later read as another). Two steps, so two step ends."""
    import gc

    from sharded_exp.predict.fake_step import fake_step

    events = fake_step(tiny_job, 2, 0, "cuda", flops=False).extra["alloc_events"]
    gc.collect()
    ends = [i for i, e in enumerate(events) if e == ("sync", None, 0, None)]
    assert len(ends) == 2 and ends[-1] == len(events) - 1, events[ends[-1] :][:5]
