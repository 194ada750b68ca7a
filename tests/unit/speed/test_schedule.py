"""The step simulator and each strategy's schedule against timelines worked by hand."""

from __future__ import annotations

import mmap

import pytest

from sharded_exp.speed.schedule import (
    Event,
    HostStepBytes,
    Schedule,
    ScheduleError,
    Segment,
    Units,
    accumulated,
    ddp,
    fsdp2,
    fsdp_grad_op,
    host_step_time,
    mfu,
    offload,
    on_shared_cores,
    oss,
    sharded_ddp,
    simulate,
    zero1,
)

MS = 1e-3


def constant(**seconds):
    """A price that gives each collective kind a fixed time (ms)."""
    return lambda kind, nbytes: seconds[kind] * MS


def test_ddp_hides_every_bucket_but_the_last():
    """4 units: forward 5 ms, backward 10 ms each, 100 B of gradients each, 100 B buckets,
    optimizer 2 ms; an all-reduce takes 4 ms. Buckets ready after bwd:3, 2, 1, 0; each of the
    first three ends under the next 10 ms backward; the last has nothing to hide under.
    Compute 20 + 40 + 2 = 62 ms; step 66 ms; exposed 4 ms (one bucket)."""
    units = Units([5 * MS] * 4, [10 * MS] * 4, [100] * 4, optimizer_s=2 * MS)
    result = simulate(ddp(units, constant(all_reduce=4), bucket_bytes=100))
    assert result.compute_s == pytest.approx(62 * MS)
    assert result.step_time_s == pytest.approx(66 * MS)
    assert result.exposed_s == pytest.approx(4 * MS) and result.comm_s == pytest.approx(16 * MS)


def test_ddp_exposes_what_the_backward_cannot_hide():
    """The same with 15 ms all-reduces: the first starts at 30 ms (end of bwd:3) and the four
    run back to back to 90 ms; the step (2 ms) ends at 92: exposed 30 ms."""
    units = Units([5 * MS] * 4, [10 * MS] * 4, [100] * 4, optimizer_s=2 * MS)
    result = simulate(ddp(units, constant(all_reduce=15), bucket_bytes=100))
    assert result.step_time_s == pytest.approx(92 * MS) and result.exposed_s == pytest.approx(30 * MS)


def test_ddp_buckets_split_a_large_unit_and_keep_the_rest_for_last():
    """250 B and 100 B units (backward order: unit 1 then 0), 100 B buckets: two buckets after
    bwd:1, then 150 B more: one after bwd:0, and a 50 B rest after bwd:0."""
    units = Units([MS] * 2, [MS] * 2, [100, 250])
    events = ddp(units, constant(all_reduce=1), bucket_bytes=100).events
    assert [(e.after, e.nbytes) for e in events] == [("bwd:1", 100), ("bwd:1", 100), ("bwd:0", 100), ("bwd:0", 50)]


def test_fsdp_prefetch_hides_behind_long_compute():
    """3 units: forward 10 ms, backward 20 ms, all-gather and reduce-scatter 4 ms each. Every
    all-gather is issued a segment ahead and ends before it is needed, every reduce-scatter but
    the last ends under a later backward. Exposed: the first all-gather (0-4 ms), the last
    unit's re-gather, issued when its forward ends (34-38), and the last reduce-scatter
    (98-102). Compute 90 ms, step 102 ms, exposed 12."""
    units = Units([10 * MS] * 3, [20 * MS] * 3, [100] * 3)
    result = simulate(fsdp2(units, constant(all_gather=4, reduce_scatter=4)))
    assert result.compute_s == pytest.approx(90 * MS)
    assert result.step_time_s == pytest.approx(102 * MS) and result.exposed_s == pytest.approx(12 * MS)
    assert result.spans["fwd:0"][0] == pytest.approx(4 * MS)
    assert result.spans["all_gather:bwd:2"] == pytest.approx((34 * MS, 38 * MS))
    assert result.spans["all_gather:bwd:1"] == pytest.approx((38 * MS, 42 * MS))  # hidden under bwd:2 (38-58)


def test_on_a_cpus_shared_cores_nothing_hides():
    """The FSDP2 step above (compute 90 ms, 6 all-gathers and 3 reduce-scatters of 4 ms: 36 ms
    of communication, 12 of it exposed on a GPU) where gloo's work takes the compute's cores:
    step 90 + 36 = 126 ms, exposed 36. A step whose waits already exceed that (the DDP step
    with 15 ms all-reduces: 92 ms against 62 + 60 = 122) is floored the same way, and one with
    nothing beside its compute is unchanged."""
    units = Units([10 * MS] * 3, [20 * MS] * 3, [100] * 3)
    shared = on_shared_cores(simulate(fsdp2(units, constant(all_gather=4, reduce_scatter=4))))
    assert shared.step_time_s == pytest.approx(126 * MS) and shared.exposed_s == pytest.approx(36 * MS)
    assert shared.compute_s == pytest.approx(90 * MS) and shared.comm_s == pytest.approx(36 * MS)
    ddp_units = Units([5 * MS] * 4, [10 * MS] * 4, [100] * 4, optimizer_s=2 * MS)
    assert on_shared_cores(simulate(ddp(ddp_units, constant(all_reduce=15), bucket_bytes=100))).step_time_s == (
        pytest.approx(122 * MS)
    )
    alone = simulate(Schedule((Segment("fwd:0", 5 * MS),)))
    assert on_shared_cores(alone) == alone


def test_fsdp_with_compute_too_short_to_hide_is_communication_bound():
    """The same with forward 1 ms, backward 2 ms, worked event by event: AG0 0-4, fwd0 4-5,
    AG1 4-8, fwd1 8-9, AG2 8-12, fwd2 12-13, AGb2 13-17, bwd2 17-19, AGb1 17-21, bwd1 21-23,
    RS2 21-25, AGb0 25-29, bwd0 29-31, RS1 29-33, RS0 33-37: step 37 ms, of which the link is
    busy 36; compute 9, exposed 28."""
    units = Units([MS] * 3, [2 * MS] * 3, [100] * 3)
    result = simulate(fsdp2(units, constant(all_gather=4, reduce_scatter=4)))
    assert result.step_time_s == pytest.approx(37 * MS) and result.comm_s == pytest.approx(36 * MS)
    assert result.exposed_s == pytest.approx(28 * MS)


def test_fsdp_grad_op_does_not_gather_again_in_backward():
    """Forward 1 ms, backward 2 ms, 4 ms collectives: AG0 0-4, fwd0 4-5, AG1 4-8, fwd1 8-9,
    AG2 8-12, fwd2 12-13, bwd2 13-15, RS2 15-19, bwd1 15-17, RS1 19-23, bwd0 17-19, RS0 23-27:
    step 27 ms, 6 collectives."""
    units = Units([MS] * 3, [2 * MS] * 3, [100] * 3)
    schedule = fsdp_grad_op(units, constant(all_gather=4, reduce_scatter=4))
    assert [e.name for e in schedule.events if ":bwd:" in e.name] == []
    assert simulate(schedule).step_time_s == pytest.approx(27 * MS)


def test_zero1_and_oss_send_the_parameters_after_the_step_exposed():
    """2 units: forward 10 ms, backward 20 ms, one bucket (all-reduce 6 ms after bwd:0),
    optimizer shard 5 ms, then 4 broadcasts of 2 ms: 60 + 6 + 5 + 8 = 79 ms, exposed 14."""
    units = Units([10 * MS] * 2, [20 * MS] * 2, [100] * 2, optimizer_s=5 * MS)
    price = constant(all_reduce=6, broadcast=2, all_gather=3)
    for schedule in (zero1(units, price, world_size=4), oss(units, price, world_size=4)):
        result = simulate(schedule)
        assert result.step_time_s == pytest.approx(79 * MS) and result.exposed_s == pytest.approx(14 * MS)
    assert simulate(zero1(units, price, 4, param_sync="all_gather")).step_time_s == pytest.approx(74 * MS)


def test_zero1_by_default_broadcasts_each_parameter_tensor_apart():
    """torch's ZeroRedundancyOptimizer (parameters_as_bucket_view off) broadcasts tensor by
    tensor: 6 tensors at 2 ms each after the step, 60 + 6 + 5 + 12 = 83 ms, exposed 18; the
    tensors unknown, one call per rank as before (79 ms)."""
    units = Units([10 * MS] * 2, [20 * MS] * 2, [100] * 2, optimizer_s=5 * MS, tensor_bytes=[50, 30, 20] * 2)
    price = constant(all_reduce=6, broadcast=2)
    result = simulate(zero1(units, price, 4, param_sync="broadcast_per_tensor"))
    assert result.step_time_s == pytest.approx(83 * MS) and result.exposed_s == pytest.approx(18 * MS)
    sent = [e.nbytes for e in zero1(units, price, 4, "broadcast_per_tensor").events if e.kind == "broadcast"]
    assert sent == [50, 30, 20, 50, 30, 20]
    unknown = Units([10 * MS] * 2, [20 * MS] * 2, [100] * 2, optimizer_s=5 * MS)
    assert simulate(zero1(unknown, price, 4, "broadcast_per_tensor")).step_time_s == pytest.approx(79 * MS)


def test_sharded_ddp_reduces_each_bucket_to_its_owner():
    """The same model with reduces (3 ms each, 100 B buckets: after bwd:1 and bwd:0): the
    first (40-43 ms) hides under bwd:0 (40-60), the second (60-63) is exposed, then the step
    (63-68) and 4 broadcasts of 2 ms: 76 ms, exposed 16."""
    units = Units([10 * MS] * 2, [20 * MS] * 2, [100] * 2, optimizer_s=5 * MS)
    schedule = sharded_ddp(units, constant(reduce=3, broadcast=2), world_size=4, bucket_bytes=100)
    assert [e.kind for e in schedule.events] == ["reduce", "reduce"] + ["broadcast"] * 4
    assert simulate(schedule).step_time_s == pytest.approx(76 * MS)


def test_sharded_ddp_without_buckets_reduces_each_gradient_tensor_when_its_unit_is_done():
    """Two units of 8 and 4 gradient bytes holding 2 and 3 tensors: the backward reaches unit 1
    first, its 3 reduces (4/3 bytes each), then unit 0's 2 (4 bytes each). One rank: each
    reduce costs its call (1 ms here)."""
    units = Units([10 * MS] * 2, [20 * MS] * 2, [8, 4], tensors_per_unit=[2, 3], optimizer_s=5 * MS)
    schedule = sharded_ddp(units, constant(reduce=1, broadcast=1), world_size=1, per_tensor=True)
    reduces = [(e.after, e.nbytes) for e in schedule.events if e.kind == "reduce"]
    assert reduces == [("bwd:1", pytest.approx(4 / 3))] * 3 + [("bwd:0", 4.0)] * 2
    # fwd 0-20, bwd:1 20-40 (its three reduces 40-43 hide under bwd:0, 40-60), bwd:0's two 60-62,
    # then the step 62-67 and one broadcast: 68 ms
    assert simulate(schedule).step_time_s == pytest.approx(68 * MS)
    # a frozen unit (no gradient) makes no call
    frozen = Units([10 * MS] * 2, [20 * MS] * 2, [8, 4], grad_bytes=[0, 4], tensors_per_unit=[0, 3])
    assert [e.after for e in sharded_ddp(frozen, constant(reduce=1, broadcast=1), 1, per_tensor=True).events
            if e.kind == "reduce"] == ["bwd:1"] * 3  # fmt: skip
    # the tensors not known: the buckets, as with buckets on
    bucketed = sharded_ddp(Units([10 * MS] * 2, [20 * MS] * 2, [8, 4]), constant(reduce=1, broadcast=1), 1, 100,
                           per_tensor=True)  # fmt: skip
    assert [e.kind for e in bucketed.events] == ["reduce", "broadcast"]


def test_offload_copies_over_pcie_and_steps_on_the_host():
    """1 unit of 400 B on 4 ranks: 100 B shards at 100 B/s = 1 s a copy; collectives 0.5 s;
    forward 1 s, backward 2 s, host step 3 s. h2d 0-1, AG 1-1.5, fwd 1.5-2.5; the re-gather's
    h2d once the forward has resharded, 2.5-3.5, AG 3.5-4, bwd 4-6, RS 6-6.5, d2h 6.5-7.5,
    host step 7.5-10.5: step 10.5 s, exposed 7.5 s."""
    units = Units([1.0], [2.0], [400])
    price = lambda kind, nbytes: 0.5
    result = simulate(offload(units, price, world_size=4, pcie_Bps=100, host_step_s=3.0))
    assert result.step_time_s == pytest.approx(10.5) and result.exposed_s == pytest.approx(7.5)
    assert result.busy_s == {"copy": 3.0, "comm": 1.5, "host": 3.0}
    # 1e9 elements: 60 bytes each in place at 100 GB/s, 16 out of place at a copy's 50
    assert host_step_time(1e9, HostStepBytes(60, 16), copy_Bps=50e9, in_place_Bps=100e9) == pytest.approx(0.92)


def test_a_host_steps_new_tensors_pay_their_pages_where_glibc_maps_them_anew():
    """1e9 elements, 8 bytes of them into new tensors each (two 4-byte temporaries a tensor), of
    which 6e8 elements in tensors whose blocks glibc maps anew: 4.8e9 bytes, 1,171,875 pages of
    4 KiB at 0.2 us: 0.234 s on top of the 0.92 s above; not priced without a page's cost."""
    moved = HostStepBytes(60, 16, new_tensors=8)
    assert host_step_time(1e9, moved, 50e9, 100e9, mapped_elements=6e8) == pytest.approx(0.92)
    pages = 6e8 * 8 / mmap.PAGESIZE
    priced = host_step_time(1e9, moved, 50e9, 100e9, mapped_elements=6e8, fresh_page_s=2e-7)
    assert priced == pytest.approx(0.92 + pages * 2e-7)
    if mmap.PAGESIZE == 4096:
        assert priced == pytest.approx(0.92 + 0.234375)


def test_offload_copies_a_shard_in_its_stored_dtype_not_the_gathers():
    """Under bf16 FSDP2 gathers 200 B of a 400 B fp32 unit (param_bytes), but CPU offload copies
    the fp32 shard to the device and casts it there; the gradient, reduce-scattered in fp32 and
    kept so, goes back as 100 B too. At 4 ranks and 100 B/s each copy is 1 s, as in the fp32
    case above (10.5 s); sized in the gather's dtype each took 0.5 s (9.0 s)."""
    units = Units([1.0], [2.0], [200], grad_bytes=[400], stored_param_bytes=[400], stored_grad_bytes=[400])
    schedule = offload(units, lambda kind, nbytes: 0.5, world_size=4, pcie_Bps=100, host_step_s=3.0)
    assert [e.nbytes for e in schedule.events if e.kind in ("h2d", "d2h")] == [100, 100, 100]
    assert simulate(schedule).step_time_s == pytest.approx(10.5)
    as_gathered = Units([1.0], [2.0], [200], grad_bytes=[200])
    assert simulate(offload(as_gathered, lambda kind, nbytes: 0.5, 4, 100, 3.0)).step_time_s == pytest.approx(9.0)


def test_accumulated_ddp_hides_its_buckets_under_the_last_micro_batch_only():
    """2 units, the step's forward 10 ms and backward 20 ms each, in 2 micro-batches (5 and 10
    ms each); one 100 B bucket a unit, 15 ms all-reduces, a 2 ms step. The first micro-batch
    communicates nothing (no_sync): 0-30 ms. The last: fwd 30-40, bwd:1 40-50, bwd:0 50-60;
    AR(bwd:1) 50-65, AR(bwd:0) 65-80; step 80-82, exposed 20 ms. Priced as one micro-batch of
    the whole step, the first all-reduce hid under a 20 ms backward: 77 ms, exposed 15."""
    units = Units([10 * MS] * 2, [20 * MS] * 2, [100] * 2, optimizer_s=2 * MS)
    price = constant(all_reduce=15)
    one = units.per_micro_batch(2)
    earlier = Schedule(tuple(Units(one.forward_s, one.backward_s, one.param_bytes).segments()))
    result = simulate(accumulated([earlier, ddp(one, price, bucket_bytes=100)]))
    assert result.compute_s == pytest.approx(62 * MS)
    assert result.step_time_s == pytest.approx(82 * MS) and result.exposed_s == pytest.approx(20 * MS)
    assert result.spans["mb0/bwd:0"] == pytest.approx((20 * MS, 30 * MS))  # the earlier one's names
    assert simulate(ddp(units, price, bucket_bytes=100)).step_time_s == pytest.approx(77 * MS)


def test_accumulated_fsdp_gathers_in_every_micro_batch_and_reduces_in_the_last():
    """2 units, the step's forward 2 ms and backward 4 ms each, 2 micro-batches (1 and 2 ms),
    4 ms collectives. First micro-batch (no reduce-scatter): AGf0 0-4, fwd0 4-5, AGf1 4-8,
    fwd1 8-9, AGb1 9-13, bwd1 13-15, AGb0 13-17, bwd0 17-19. The last, its first gathers
    issued at 19: AGf0 19-23, fwd0 23-24, AGf1 23-27, fwd1 27-28, AGb1 28-32, bwd1 32-34,
    AGb0 32-36, bwd0 36-38, RS1 36-40, RS0 40-44: step 44 ms, 8 gathers and 2 reduce-scatters
    (40 ms on the link). As one micro-batch: 26 ms, 4 gathers."""
    units = Units([2 * MS] * 2, [4 * MS] * 2, [100] * 2)
    price = constant(all_gather=4, reduce_scatter=4)
    one = units.per_micro_batch(2)
    schedule = accumulated([fsdp2(one, price, reduce_gradients=False), fsdp2(one, price)])
    assert [e.kind for e in schedule.events].count("all_gather") == 8
    assert [e.kind for e in schedule.events].count("reduce_scatter") == 2
    result = simulate(schedule)
    assert result.step_time_s == pytest.approx(44 * MS) and result.comm_s == pytest.approx(40 * MS)
    assert result.spans["all_gather:fwd:0"] == pytest.approx((19 * MS, 23 * MS))  # issued as mb0 ends
    assert simulate(fsdp2(units, price)).step_time_s == pytest.approx(26 * MS)
    assert accumulated([fsdp2(units, price)]).events == fsdp2(units, price).events  # one: unchanged


def test_the_parameter_sync_sends_the_optimizers_tensors_only():
    """ZeRO-1 with one flat buffer a rank: 200 B of parameters, of which the optimizer steps
    80 B (the rest frozen: neither stepped nor sent): 4 broadcasts of 20 B, not 50."""
    units = Units([MS] * 2, [MS] * 2, [100] * 2, tensor_bytes=[50, 30])
    sent = [e.nbytes for e in zero1(units, constant(all_reduce=1, broadcast=1), 4, "broadcast").events
            if e.kind == "broadcast"]  # fmt: skip
    assert sent == [20.0] * 4


def test_a_wait_that_can_never_end_is_a_deadlock():
    schedule = Schedule((Segment("a", 1), Segment("b", 1)), (Event("x", "all_gather", 1, after="b", before="a"),))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule)
    with pytest.raises(ScheduleError, match="twice"):
        Schedule((Segment("a", 1),), (Event("a", "all_gather", 1, after=None),))
    with pytest.raises(ScheduleError, match="neither a segment nor an earlier event"):
        Schedule((Segment("a", 1),), (Event("x", "all_gather", 1, after="y"),))


def test_mfu_is_model_flops_over_time_times_peak():
    """1e15 FLOPs in 2 s on a 989 TFLOP/s peak: 1e15 / (2 * 989e12) = 50.56 %."""
    assert mfu(1e15, 2.0, 989e12) == pytest.approx(50.556, rel=1e-4)
