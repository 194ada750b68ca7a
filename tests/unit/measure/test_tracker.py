"""sharded_exp.measure.tracker, in this process on tiny tensors: storages counted once,
model states from the real tensors, the CPU tracker's peak by category (buckets
included), its guarded hooks, what it keeps when a budget is exceeded, the CPU meter's
window, build and budget, and the host memory readers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo  # noqa: F401 -- an optimizer's first step imports it; paid at collection
from torch import nn

from sharded_exp.measure import tracker as tracker_module
from sharded_exp.measure.tracker import (
    MIB,
    MemoryMeter,
    _breakdown_mib,
    _status_mib,
    _storage_bytes,
    communication_buffers,
    filed_as,
    host_peak,
    model_state_mib,
    peak_breakdown_mib,
    process_peak_rss_mib,
)

CPU = torch.device("cpu")
LINEAR_BYTES = (8 * 4 + 8) * 4  # nn.Linear(4, 8) in float32


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 8)


def owner(module: nn.Module, optimizers=()):
    """What the meter reads of a strategy: the module and its local optimizers."""
    return SimpleNamespace(module=module, local_optimizers=lambda: list(optimizers))


# ------------------------------------------------------------------- storage bytes
def test_storage_bytes_count_each_storage_once_and_skip_meta_none_and_empty():
    a = torch.zeros(10)
    b = torch.zeros(3, dtype=torch.float64)
    seen: set = set()
    tensors = [a, a[2:5], a.view(2, 5), b, None, torch.zeros(0), torch.empty(100, device="meta")]
    assert _storage_bytes(tensors, seen) == 10 * 4 + 3 * 8
    assert _storage_bytes([a[1:], torch.ones(2)], seen) == 2 * 4  # a was seen already


def test_model_states_are_params_grads_and_adams_moments_and_steps():
    model = linear()
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    states = model_state_mib(model, [optimizer])
    assert states["params"] * MIB == LINEAR_BYTES
    assert states["grads"] * MIB == LINEAR_BYTES
    # exp_avg and exp_avg_sq per parameter, and a 0-dim float32 step per tensor
    assert states["optimizer"] * MIB == 2 * LINEAR_BYTES + 2 * 4


def test_gradients_that_are_views_into_one_bucket_count_the_bucket_once():
    model = linear()
    bucket = torch.zeros(8 * 4 + 8 + 24)  # 24 elements of padding: the whole bucket counts
    model.weight.grad = bucket[:32].view(8, 4)
    model.bias.grad = bucket[32:40]
    assert model_state_mib(model, [])["grads"] * MIB == bucket.numel() * 4


def test_a_gradient_sharing_its_parameters_storage_is_counted_as_the_parameter():
    model = linear()
    model.bias.grad = model.bias.detach()
    states = model_state_mib(model, [])
    assert states["params"] * MIB == LINEAR_BYTES and states["grads"] == 0


# ---------------------------------------------------------------- the CPU tracker
def test_the_peak_holds_what_was_live_together_by_category():
    model = linear()
    kept = []

    def region():
        a = torch.ones(1024)  # 4 KiB
        b = torch.ones(2048)  # 8 KiB, while a lives
        del a, b
        kept.append(torch.ones(512))  # 2 KiB, after both are gone

    peak = peak_breakdown_mib(region, model)
    assert peak["Total"] * MIB == LINEAR_BYTES + (1024 + 2048) * 4
    assert peak["Parameter"] * MIB == LINEAR_BYTES


def test_tensors_made_for_communication_are_filed_as_buckets():
    kept = []

    def region():
        with communication_buffers():
            kept.append(torch.zeros(256))
        kept.append(torch.zeros(64))

    peak = peak_breakdown_mib(region)
    assert peak["Bucket"] * MIB == 256 * 4
    assert peak["Total"] * MIB == (256 + 64) * 4
    assert tracker_module._FILED_AS.get() is None  # reset on the way out


def test_the_innermost_filing_holds_and_each_is_undone_on_the_way_out():
    kept = []

    def region():
        with filed_as("Bucket"):
            kept.append(torch.zeros(256))
            with communication_buffers():
                kept.append(torch.zeros(64))
            assert tracker_module._FILED_AS.get() == "Bucket"
        kept.append(torch.zeros(32))

    peak = peak_breakdown_mib(region)
    assert peak["Bucket"] * MIB == (256 + 64) * 4
    assert peak["Total"] * MIB == (256 + 64 + 32) * 4
    assert tracker_module._FILED_AS.get() is None


def test_a_category_the_vocabulary_does_not_list_is_refused_by_name():
    with pytest.raises(ValueError, match=r"filed_as\('Staging'\).*OWN_CATEGORIES lists 'Bucket'"):
        with filed_as("Staging"):
            pass
    assert tracker_module._FILED_AS.get() is None


def test_breakdown_mib_reads_the_devices_peak_by_category_name():
    from enum import Enum

    class Ref(Enum):
        PARAM = "Parameter"

    tracker = SimpleNamespace(get_tracker_snapshot=lambda kind: {CPU: {Ref.PARAM: MIB, "Total": 3 * MIB}})
    assert _breakdown_mib(tracker, CPU) == {"Parameter": 1.0, "Total": 3.0}
    assert _breakdown_mib(tracker, torch.device("cuda", 0)) == {}


# ------------------------------------------------------------------ the CPU meter
def test_the_cpu_meter_measures_its_window_and_then_the_states_between_steps():
    model = linear()
    meter = MemoryMeter(CPU)
    meter.start(model)
    assert meter.tracking and meter.source == "torch_mem_tracker"
    out = torch.ones(64)  # 256 B live at the end of the window
    result = meter.stop()
    assert not meter.tracking
    assert result["peak_allocated_mib"] * MIB == LINEAR_BYTES + 256
    assert result["peak_breakdown_mib"]["Parameter"] * MIB == LINEAR_BYTES
    assert result["peak_reserved_mib"] is None and result["peak_error"] is None and result["ooms"] is None
    live, peak, reserved = meter.now(owner(model))
    assert live * MIB == LINEAR_BYTES and peak == result["peak_allocated_mib"] and reserved == -1.0
    del out


def test_a_meter_that_cannot_start_reports_a_null_peak_and_why():
    meter = MemoryMeter(CPU)
    meter.start(object())  # nothing the tracker can track
    assert not meter.tracking and meter.failure.startswith("the CPU memory tracker could not start: ")
    result = meter.stop()
    assert result["peak_allocated_mib"] is None and result["peak_error"] == meter.failure


def test_a_tracked_step_over_the_budget_raises_out_of_memory_with_its_record():
    model = linear()
    meter = MemoryMeter(CPU, limit_mib=(LINEAR_BYTES + 512) / MIB)
    meter.start(model)
    meter.step_end(0)  # the parameters fit
    held = torch.ones(1024)  # 4 KiB more: over
    with pytest.raises(torch.OutOfMemoryError, match=r"over trainer.memory_limit_mib="):
        meter.step_end(1)
    assert not meter.tracking
    record = meter.oom_breakdown
    assert record["step"] == 1 and record["limit_mib"] == meter.limit_mib
    assert record["tracked_mib"] * MIB == LINEAR_BYTES + 4096
    del held


def test_the_build_peak_is_kept_apart_and_what_the_strategy_allocated_is_buckets():
    meter = MemoryMeter(CPU)
    meter.start()
    model = linear()  # built inside the window
    bucket = torch.zeros(128)  # the strategy's communication buffer: 512 B
    scratch = torch.ones(1024)
    del scratch  # 4 KiB for a moment while building
    meter.built(owner(model))
    assert meter.build["peak_allocated_mib"] * MIB == LINEAR_BYTES + 512 + 4096
    result = meter.stop()
    assert result["build_peak_mib"] == meter.build["peak_allocated_mib"]
    assert result["peak_breakdown_mib"]["Bucket"] * MIB == 512  # the peak restarted after the build
    assert result["peak_breakdown_mib"]["Parameter"] * MIB == LINEAR_BYTES
    assert result["peak_allocated_mib"] * MIB == LINEAR_BYTES + 512
    del bucket


def test_a_build_over_the_budget_is_raised_once_the_run_can_record_it():
    meter = MemoryMeter(CPU, limit_mib=1024 / MIB)
    meter.start()
    model = linear()
    big = torch.zeros(1024)
    meter.built(owner(model))
    assert meter.tracking  # found, not yet raised
    with pytest.raises(torch.OutOfMemoryError, match="while the model was built"):
        meter.check_build()
    assert not meter.tracking and meter.oom_breakdown["phase"].startswith("building the model (")
    del big


def test_an_over_limit_record_without_a_moment_says_so():
    meter = MemoryMeter(CPU, limit_mib=5.0)
    record = meter._over_limit(SimpleNamespace(over_limit=None), 7, "after training")
    assert record == {
        "step": 7,
        "limit_mib": 5.0,
        "error": "the tracker saw no moment over the budget",
        "phase": "after training (None)",
    }


def test_the_guard_checks_a_phase_outside_the_window_against_the_budget():
    model = linear()
    meter = MemoryMeter(CPU, limit_mib=(LINEAR_BYTES + 1024) / MIB)
    with meter.guard(owner(model)):
        small = torch.ones(128)  # 512 B: fits
    with pytest.raises(torch.OutOfMemoryError, match="after training"):
        with meter.guard(owner(model)):
            big = torch.ones(1024)  # 4 KiB: over
    assert meter.oom_breakdown["phase"].startswith("after training")
    del small, big


def test_the_guard_does_nothing_without_a_budget():
    meter = MemoryMeter(CPU)
    with meter.guard(owner(linear())):
        big = torch.ones(1 << 16)
    assert meter.oom_breakdown is None
    del big


# ------------------------------------------------------------------------ host memory
def test_status_fields_are_read_in_mib():
    rss = _status_mib("VmRSS")
    assert rss is not None and 0 < rss <= process_peak_rss_mib() + 1
    assert _status_mib("NoSuchField") is None


def test_host_peak_measures_what_a_region_adds():
    result: dict = {}
    with host_peak(result):
        block = torch.ones(64 * MIB // 4)  # 64 MiB, every page touched
        del block
    assert result["mib"] >= 48  # the kernel's high-water mark, less what was resident before
    assert process_peak_rss_mib() >= result["mib"]


def test_the_pinned_host_memory_is_the_host_allocators_blocks_or_null(monkeypatch):
    """A CUDA run records the pinned blocks torch holds (offload's shards) at their rounded
    sizes; a reading that fails leaves null, and the run goes on."""
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 3 * 2**20})
    assert tracker_module.pinned_host_mib() == 3.0
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {})  # CUDA never started: nothing pinned
    assert tracker_module.pinned_host_mib() == 0.0

    def broken():
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "host_memory_stats", broken)
    assert tracker_module.pinned_host_mib() is None
