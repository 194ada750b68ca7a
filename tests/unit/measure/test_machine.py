"""The this profile: built from cached measurements (measuring itself starts processes: the
integration tier runs it)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from sharded_exp.measure import machine


def test_the_profile_is_built_from_the_cache_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01], [1e9, 0.05]], "bf16": [[1e9, 0.08]]}, "memory_bandwidth_GBps": 10.0,
               "op_overhead_s": 5e-6, "step_op_overhead_s": {"fp32": 2e-5, "bf16": 3e-5},
               "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0}, "measured_at": "then"}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(3): figures}))
    monkeypatch.setattr(machine, "measure", lambda threads: pytest.fail("measured although cached"))
    device, link = machine.this_profile(3)
    assert device.name == "this" and device.op_overhead_s == 5e-6 and device.memory_bandwidth_Bps == 10e9
    assert device.host_cost_s("bf16") == 3e-5 and device.host_cost_s("fp16") == 5e-6  # none measured: the lone op's
    assert not device.asynchronous  # a CPU runs its ops one after the other
    assert device.peak_flops_per_s("fp32") == 0.05e12 and device.curve("matmul", "fp32").points[0] == (1e6, 0.01)
    assert link.bandwidth_Bps == 0.5e9 and link.ring_step_latency_s == pytest.approx(1e-4)
    assert link.reduce_scatter_as_all_reduce  # gloo's: priced as the all-reduce it runs
    assert link.solo_call_s == {}  # figures cached before the call was measured: none priced
    assert device.curve("attention", "fp32") == device.curve("matmul", "fp32")  # attention not measured
    assert not device.curve("attention", "fp32").causal_calls  # so no causal curve: priced as the matmul's
    assert device.host_cost_s("fp32", sharded_parameters=True) == 2e-5  # nor an FSDP2 step: the plain figure
    with pytest.raises(ValueError, match="bf16"):  # MFU on a CPU in fp32 only, as a run's mfu_pct
        device.peak_flops_per_s("bf16")


def test_attention_and_the_fsdp2_steps_host_cost_are_read_where_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01], [1e9, 0.05]]}, "attention": {"fp32": [[1e8, 0.002], [2e9, 0.02]]},
               "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6, "step_op_overhead_s": {"fp32": 2e-5},
               "sharded_step_op_overhead_s": {"fp32": 7e-5}, "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0}}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(2): figures}))
    device, _ = machine.this_profile(2)
    assert device.curve("attention", "fp32").points == ((1e8, 0.002), (2e9, 0.02))
    assert device.curve("attention", "fp32").causal_calls  # measured on causal calls
    assert device.host_cost_s("fp32") == 2e-5 and device.host_cost_s("fp32", sharded_parameters=True) == 7e-5


def test_attention_is_measured_with_the_flops_the_trace_counts():
    points = machine.measure_attention(torch.float32, seconds=0.01)
    batch_heads, seq = machine.ATTENTION_SHAPES[0]
    forward = 4 * batch_heads * seq * seq * machine.ATTENTION_HEAD_DIM
    assert points[0][0] == forward * 3.5 and all(rate > 0 for _, rate in points)


def test_remeasure_measures_again_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    fresh = {"matmul": {"fp32": [[1e6, 0.02]]}, "memory_bandwidth_GBps": 1.0, "op_overhead_s": 1e-6,
             "link": {"bandwidth_GBps": 1.0, "step_latency_us": 1.0}}  # fmt: skip
    monkeypatch.setattr(machine, "measure", lambda threads: calls.append(threads) or dict(fresh))
    machine.this_figures(2)
    machine.this_figures(2)
    machine.this_figures(2, remeasure=True)
    assert calls == [2, 2]


def test_the_gpu_profile_is_built_from_the_cache_with_the_datasheet_peak_where_the_name_is_known(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"bf16": [[1e9, 100.0], [1e12, 700.0]], "fp32": [[1e12, 50.0]]}, "memory_GB": 150.0,
               "memory_bandwidth_GBps": 4000.0, "op_overhead_s": 8e-6, "device_name": "NVIDIA H200",
               "step_op_overhead_s": {"fp32": 2e-5, "bf16": 2.5e-5, "fp16": 2.5e-5}}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(1, "cuda"): figures}))
    monkeypatch.setattr(machine, "measure_cuda_in_child", lambda: pytest.fail("measured although cached"))
    gpu = machine.this_cuda_profile()
    assert gpu.title == "this machine (NVIDIA H200)" and gpu.op_overhead_s == 8e-6 and gpu.asynchronous
    assert gpu.host_cost_s("bf16") == 2.5e-5
    assert gpu.peak_flops_per_s("bf16") == pytest.approx(989e12)  # the datasheet's: MFU as a run counts it
    assert gpu.curve("matmul", "bf16").points[-1] == (1e12, 700.0)
    assert gpu.host_memory is None and machine.this_cuda_host_link() is None  # no host side measured
    figures["device_name"] = "Some GPU"
    path.write_text(json.dumps({machine._key(1, "cuda"): figures}))
    assert machine.this_cuda_profile().peak_flops_per_s("fp32") == pytest.approx(50e12)  # no table: the best measured
    # the host's side, measured with the GPU: offload's copies at the slower direction, its step at the host's share
    figures["host"] = {"memory_bandwidth_GBps": 200.0, "in_place_GBps": 300.0, "threads": 64, "h2d_GBps": 50.0,
                       "d2h_GBps": 40.0, "fresh_page_s": 2e-7}  # fmt: skip
    path.write_text(json.dumps({machine._key(1, "cuda"): figures}))
    assert machine.this_cuda_profile().host_memory.per_rank(4, 4) == pytest.approx((50e9, 75e9))  # 4 ranks share it
    assert machine.this_cuda_profile().host_memory.fresh_page_s == 2e-7
    assert machine.this_cuda_host_link().bandwidth_Bps == pytest.approx(40e9)


@pytest.mark.parametrize(
    "name, profile",
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_sxm"), ("NVIDIA H100 PCIe", None),
     ("NVIDIA A100-SXM4-80GB", "a100_80gb"), ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("NVIDIA H200 NVL", None),
     ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-32GB", "v100_32gb"),
     # PCIe cards are linked by PCIe, not NVLink: no profile (their links were priced as NVLink's, 7-10x fast)
     ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("Tesla V100-PCIE-32GB", None)],
)  # fmt: skip
def test_a_cuda_device_name_finds_its_sourced_profile(name, profile):
    from sharded_exp.speed.profiles import profile_for_device_name

    assert profile_for_device_name(name) == profile


def test_a_tiny_steps_host_cost_per_op_counts_the_ops_the_time_model_counts():
    """The count follows the time model's rule; the measurement itself runs (for real, on this
    CPU, a fraction of a second): its value is the machine's, so only its sign is held."""
    a = torch.ones(2, 2)
    counter = machine._OpCount()
    with counter:
        torch.mm(a, a).view(4).add(1)
    assert counter.count == 2  # the mm and the add; the view is not counted
    assert machine.measure_step_op_overhead("cpu", "fp32", seconds=0.02) > 0


def test_the_optimizers_step_is_timed_alone_over_its_own_ops(monkeypatch):
    """Each window's time over the ops one call runs: Adam's step on the tiny model's 16
    tensors (per tensor on a CPU: torch's choice there) alone, no forward or backward op; the
    forward and backward over theirs, the step's left out."""
    monkeypatch.setattr(machine, "_timed", lambda fn, seconds: 1.0)  # one second a call: 1 / ops
    per_op = machine.measure_optimizer_op_overhead("cpu", seconds=0.01)
    counted = machine._OpCount()
    model, optimizer, x = machine._tiny_model("cpu", sharded=False)
    model(x).square().mean().backward()
    optimizer.step()
    with counted:
        optimizer.step()
    assert per_op == pytest.approx(1 / counted.count) and counted.count >= 16  # at least an op a tensor
    forward_backward = machine.measure_step_op_overhead("cpu", "fp32", seconds=0.01)
    optimizer.zero_grad(set_to_none=True)  # as each measured call starts: no gradient to add to
    counted = machine._OpCount()
    with counted:
        model(x).float().square().mean().backward()
    assert forward_backward == pytest.approx(1 / counted.count)


def test_the_optimizers_ops_are_priced_at_their_own_figure_where_measured():
    """Not measured (a profile cached before it was, the H200's stored one): the step's fp32
    figure prices them, as it did."""
    figures = {"op_overhead_s": 1e-6, "step_op_overhead_s": {"fp32": 20e-6, "bf16": 30e-6},
               "sharded_step_op_overhead_s": {"fp32": 40e-6}}  # fmt: skip
    from sharded_exp.speed.profiles import DeviceProfile, Figure, Source

    source = Source("measured", "a test", "-")
    plain = DeviceProfile(name="t", title="t", memory=Figure(0.0, source, "-"), memory_bandwidth=Figure(1.0, source),
                          peak_tflops={}, **figures)  # fmt: skip
    assert plain.host_cost_s("bf16", optimizer=True) == 20e-6  # fp32's, whatever the math dtype
    assert plain.host_cost_s("fp32", sharded_parameters=True, optimizer=True) == 40e-6
    # an FSDP2 optimizer's figure not measured (its spawned process failed): the plain optimizer's
    assert dataclasses.replace(plain, optimizer_op_overhead_s=5e-6).host_cost_s("fp32", True, optimizer=True) == 5e-6
    measured = dataclasses.replace(plain, optimizer_op_overhead_s=5e-6, sharded_optimizer_op_overhead_s=9e-6)
    assert measured.host_cost_s("bf16", optimizer=True) == 5e-6 and measured.host_cost_s("bf16") == 30e-6
    assert measured.host_cost_s("fp32", sharded_parameters=True, optimizer=True) == 9e-6


def test_elementwise_rates_and_layout_curves_are_read_per_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01]]}, "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6,
               "step_op_overhead_s": {"fp32": 2e-5}, "elementwise_GBps": {"fp32": {"gelu": 2.0}, "bf16": {"gelu_backward": 1.5}},
               "matmul_layouts": {"fp32": {"tn": [[1e6, 0.01], [1e9, 0.04]]}},
               "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0}}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(2): figures}))
    device, _ = machine.this_profile(2)
    assert device.elementwise_Bps == {("gelu", "fp32"): 2e9, ("gelu_backward", "bf16"): 1.5e9}
    assert list(device.layout_curves) == [("tn", "fp32")]
    assert device.layout_curves[("tn", "fp32")].points == ((1e6, 0.01), (1e9, 0.04))


def test_elementwise_ops_are_measured_by_the_bytes_the_trace_counts(monkeypatch):
    """Each call timed at 1 s: its rate is then its bytes. GELU reads and writes 2^20 fp32
    elements (8,388,608 bytes); its backward reads two and writes one; layer norm's forward
    reads x, weight and bias and writes y, mean and rstd (2048 rows of 512)."""
    monkeypatch.setattr(machine, "_timed", lambda fn, seconds: 1.0)
    rates = machine.measure_elementwise(torch.float32)
    n = machine.ELEMENTWISE_ELEMENTS
    assert rates["gelu"] == pytest.approx(2 * 4 * n / 1e9)
    assert rates["gelu_backward"] == pytest.approx(3 * 4 * n / 1e9)
    rows, row = n // machine.ELEMENTWISE_ROW, machine.ELEMENTWISE_ROW
    assert rates["native_layer_norm"] == pytest.approx(4 * (2 * n + 2 * row + 2 * rows) / 1e9)
    assert {"tanh_backward", "_log_softmax_backward_data", "native_layer_norm_backward", "pow"} <= set(rates)
    assert machine.measure_elementwise(torch.bfloat16, seconds=0.001)["gelu"] == pytest.approx(2 * 2 * n / 1e9)


@pytest.mark.parametrize(
    "layout, a_stride, b_stride", [("nt", (8, 1), (1, 8)), ("nn", (8, 1), (8, 1)), ("tn", (1, 8), (8, 1))]
)
def test_a_linear_layers_matmuls_are_measured_in_its_layouts_on_separate_operands(layout, a_stride, b_stride):
    """Tokens 32, width 8: x (32 x 8) and W (8 x 8) per pair, or two 32 x 8 for the weight's
    gradient; a pool of 1100 elements holds 3 pairs of 320 (2 of 512 for tn), none shared."""
    pool = torch.arange(1100.0)
    pairs = machine._layout_operands(layout, 32, 8, pool)
    assert len(pairs) == (2 if layout == "tn" else 3)
    a, b = pairs[0]
    assert (a.stride(), b.stride(), (a @ b).shape) == (a_stride, b_stride, (8, 8) if layout == "tn" else (32, 8))
    starts = sorted(t.storage_offset() for pair in pairs for t in pair)
    assert len(set(starts)) == len(starts)


def test_the_layout_curves_count_a_linear_layers_flops(monkeypatch):
    """2 x tokens x width^2 FLOPs per call, tokens = 8 x width; every call timed at 1 ms."""
    monkeypatch.setattr(machine, "_timed", lambda fn, seconds: (fn(), 1e-3)[1])
    monkeypatch.setattr(machine, "OPERAND_POOL_BYTES", 32 * 2**20)  # a pair of the widest tn: 16 MiB
    curves = machine.measure_matmul_layouts(torch.float32)
    flops = [2.0 * 8 * w**3 for w in machine.LINEAR_WIDTHS]
    assert set(curves) == {"nt", "nn", "tn"}
    assert curves["tn"] == [(f, f / 1e-3 / 1e12) for f in flops]


def test_what_other_processes_spent_is_the_machines_busy_time_less_this_processs():
    """/proc/stat's busy jiffies (steal included: a VM's neighbours) less this process's CPU:
    100 more jiffies of anyone's user time read as 100 / CLK_TCK seconds more elsewhere."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    quiet = machine.cpu_elsewhere_s("cpu  1000 0 500 9000 10 0 20 5 0 0")
    busier = machine.cpu_elsewhere_s("cpu  1100 0 500 9000 10 0 20 5 0 0")
    stolen = machine.cpu_elsewhere_s("cpu  1000 0 500 9000 10 0 20 105 0 0")
    assert busier - quiet == pytest.approx(100 / tick, abs=0.05)  # this process's CPU moves a little between reads
    assert stolen - quiet == pytest.approx(100 / tick, abs=0.05)
    assert machine.cpu_elsewhere_s("intr 1 2 3") is None


@pytest.mark.parametrize(
    "cores, threads, cpus, expected",
    [(None, 2, 2, False), (0.2, 2, 2, False), (0.8, 2, 2, True), (1.2, 1, 2, False), (1.7, 1, 2, True),
     (3.0, 4, 16, False)],
)  # fmt: skip
def test_a_profile_is_disturbed_when_others_took_cores_its_threads_needed(cores, threads, cpus, expected):
    assert machine.disturbed(cores, threads, cpus) is expected


def test_a_disturbed_profile_is_measured_again_and_the_least_disturbed_kept(monkeypatch, caplog):
    """Two cores, two threads: a measurement while others used 1.5 cores is measured again;
    an undisturbed second one is kept; if neither is, the less disturbed, with a warning."""
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    runs = iter([{"elsewhere_cores": 1.5, "n": 0}, {"elsewhere_cores": 0.1, "n": 1}, {"elsewhere_cores": 0.0, "n": 2}])
    monkeypatch.setattr(machine, "measure", lambda threads: next(runs))
    assert machine._least_disturbed(2)["n"] == 1
    runs = iter([{"elsewhere_cores": 1.5, "n": 0}, {"elsewhere_cores": 0.8, "n": 1}, {"elsewhere_cores": 0.0, "n": 2}])
    monkeypatch.setattr(machine, "measure", lambda threads: next(runs))
    with caplog.at_level("WARNING"):
        assert machine._least_disturbed(2)["n"] == 1  # two tries at most (ATTEMPTS)
    assert "0.80 cores" in caplog.text and "2 tries" in caplog.text


def test_a_disturbed_profile_says_so_in_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    figures = {"matmul": {"fp32": [[1e6, 0.01]]}, "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6,
               "step_op_overhead_s": {"fp32": 2e-5}, "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0},
               "measured_at": "then", "elsewhere_cores": 0.9}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(2): figures}))
    device, _ = machine.this_profile(2)
    assert "other processes using 0.90 cores" in device.memory_bandwidth.source.title


def test_the_hosts_memory_is_kept_when_the_gpus_pinned_copies_cannot_be_measured(monkeypatch):
    """Pinned memory refused (``ulimit -l``): the host's memory figures stay, the link is left
    out (logged); the threads measured are the cores this process may run on, restored after."""
    import torch

    monkeypatch.setattr(machine, "measure_bandwidth", lambda seconds, nbytes: 12.0)
    monkeypatch.setattr(machine, "measure_in_place", lambda seconds, nbytes: 20.0)
    monkeypatch.setattr(machine, "measure_fresh_page_s", lambda: 2e-7)

    def refused():
        raise RuntimeError("cannot pin memory")

    monkeypatch.setattr(machine, "_pinned_copies", refused)
    before = torch.get_num_threads()
    found = machine.measure_host_side()
    assert found == {"memory_bandwidth_GBps": 12.0, "in_place_GBps": 20.0, "threads": len(os.sched_getaffinity(0)),
                     "fresh_page_s": 2e-7}  # fmt: skip
    assert torch.get_num_threads() == before


def test_a_collectives_call_alone_is_read_per_kind_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01]]}, "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6,
               "step_op_overhead_s": {}, "measured_at": "then",
               "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0,
                        "solo_call_us": {"broadcast": 24.0, "all_gather": 36.0}}}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(1): figures}))
    _, link = machine.this_profile(1)
    assert link.solo_call_s == pytest.approx({"broadcast": 24e-6, "all_gather": 36e-6})


def test_a_collectives_call_between_the_two_ranks_is_read_per_kind_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01]]}, "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6,
               "step_op_overhead_s": {}, "measured_at": "then",
               "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0, "pair_call_us": {"broadcast": 80.0}}}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(1): figures}))
    _, link = machine.this_profile(1)
    assert link.pair_call_s == pytest.approx({"broadcast": 80e-6}) and link.solo_call_s == {}


def test_each_kinds_call_moves_the_size_asked_for_and_its_root_takes_turns(monkeypatch):
    """Two ranks, as the link's measurement has them (the calls recorded, not made): S as
    nccl-tests counts it, an all-gather's output and a reduce-scatter's input whole, their other
    buffer a rank's half; a broadcast's and a reduce's root each rank in turn."""
    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    for name in ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(
            (_name, [x.numel() if isinstance(x, torch.Tensor) else x for x in a])))  # fmt: skip
    found = machine.calls_s(None, 256, 2)
    assert set(found) == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"}
    shapes = {name: args for name, args in calls}
    assert shapes["all_reduce"] == [256]
    assert shapes["all_gather_into_tensor"] == [256, 128] and shapes["reduce_scatter_tensor"] == [128, 256]
    roots = [args[1] for name, args in calls if name == "broadcast"]
    assert roots[:4] == [0, 1, 0, 1]  # one warm-up and the windows' calls, alternating


def test_a_collectives_call_alone_is_timed_per_kind_in_a_group_of_one(gloo_group):
    found = machine.solo_call_s(dist.group.WORLD)
    assert set(found) == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"}
    assert all(0 < s < 1 for s in found.values())


def _gloo_ring_segments_with_data(elements: int, ranks: int, element_bytes: int = 4) -> list[bool]:
    """Which segments of gloo's ring all-reduce carry data (``gloo/allreduce.cc``, ``ring``:
    at least 2 x ranks segments, a multiple of ranks, each a whole number of elements)."""
    total = elements * element_bytes
    segments = max(2 * ranks, ranks)
    size = -(-total // segments)
    size = -(-size // element_bytes) * element_bytes
    return [k * size < total for k in range(segments)]


def test_the_links_latency_is_timed_on_an_all_reduce_that_travels_both_ways():
    # one float fills one of a 2-rank ring's 4 segments: its other rank's chunk never travels
    assert _gloo_ring_segments_with_data(1, 2) == [True, False, False, False]
    assert all(_gloo_ring_segments_with_data(machine.LATENCY_ELEMENTS, 2))
    # and its bytes are a negligible part of the call at the link's bandwidth (about 1-2 GB/s here)
    assert machine.LATENCY_ELEMENTS * 4 <= 4096


def test_a_call_longer_than_its_budget_is_timed_once_and_a_short_one_in_windows(monkeypatch):
    """fp16's largest matmul on a CPU that emulates it took 2 s a call: the warm-up and five
    windows of at least one call each were 12 s of the profile's 30. Such a call is timed once."""
    clock = iter(range(100))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: float(next(clock)))
    calls = []
    assert machine._timed(lambda: calls.append(1), seconds=0.5) == 1.0  # each call "takes" a tick
    assert len(calls) == 1
    calls.clear()
    clock = iter(x * 0.01 for x in range(1000))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    assert machine._timed(lambda: calls.append(1), seconds=0.5) == pytest.approx(0.01)
    assert len(calls) > machine.WINDOWS  # the warm-up, then every window
