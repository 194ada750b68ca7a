"""The shipped profiles load, every figure names a source, and a file that breaks the rules
is refused with a message that says what is wrong."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from sharded_exp.speed.profiles import (
    ProfileError,
    device_names,
    link_names,
    load_device,
    load_link,
    network_link,
    parse_device,
    parse_link,
)

GOOD = {
    "kind": "device", "name": "toy", "title": "a toy GPU",
    "sources": {"sheet": {"title": "Toy datasheet", "url": "https://example.org/toy.pdf"}},
    "memory_GB": {"value": 16, "source": "sheet"},
    "memory_bandwidth_GBps": {"value": 1000, "source": "sheet"},
    "peak_TFLOPs": {"bf16": {"value": 100, "source": "sheet"}},
    "achievable_fraction": {"bf16": {"value": 0.8, "source": "sheet"}},
}  # fmt: skip


ROOT = Path(__file__).resolve().parents[3]


def test_the_named_gpus_and_links_ship_and_every_figure_has_a_source():
    assert device_names() == ["a100_40gb", "a100_80gb", "h100_hbm2e_500w", "h100_sxm", "h200", "v100_32gb"]
    assert link_names() == ["nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "pcie5"]
    for name in device_names():
        device = load_device(name)
        figures = [device.memory, device.memory_bandwidth, *device.peak_tflops.values(),
                   *device.achievable_fraction.values()]  # fmt: skip
        figures += [device.memory_bandwidth_fraction] if device.memory_bandwidth_fraction else []
        # a published page, or a measurement of this project's kept in the repository
        assert all((f.source.url.startswith("https://") or (ROOT / f.source.url).is_file()) and f.source.title
                   for f in figures), name  # fmt: skip
    for name in link_names():
        link = load_link(name)
        bus = [link.bus_bandwidth_fraction] if link.bus_bandwidth_fraction else []
        assert all(f.source.url.startswith("https://") for f in (link.bandwidth, link.ring_step_latency, *bus))


def test_datasheet_figures_read_as_si_units():
    """A100 80 GB: 2,039 GB/s; H100 bf16: 989 TFLOP/s peak, 0.801 of it measured (792.1);
    NVLink 4: 900 GB/s both ways, 450 GB/s one way; PCIe 4 x16: 31.5 GB/s one way."""
    assert load_device("a100_80gb").memory_bandwidth.value * 1e9 == 2039e9
    h100 = load_device("h100_sxm")
    assert h100.peak_flops_per_s("bf16") == 989e12 and h100.is_measured("bf16")
    assert h100.matmul_flops_per_s("bf16") == pytest.approx(792.2e12, rel=1e-3)
    assert load_link("nvlink4").bandwidth.value * 1e9 == 450e9
    assert load_link("pcie4").bandwidth_Bps == 31.5e9 and load_link("pcie4").ring_step_latency_s == pytest.approx(
        5.7e-6
    )


def test_the_grand_teton_h100_has_its_own_memory_and_the_sxm5_compute_as_a_bound():
    """torchtitan's H100s: 96 GB of HBM2e at 2.4 TB/s (the SXM5: 80 GB of HBM3 at 3.35), so a
    memory-bound op takes 3.35 / 2.4 = 1.40 times as long; their compute is not published, and
    the SXM5's is used, each such figure saying it is an upper bound."""
    part, sxm = load_device("h100_hbm2e_500w"), load_device("h100_sxm")
    assert part.memory_bytes == 96e9 and part.memory_bandwidth_Bps == 2400e9
    assert "torchtitan" in part.memory_bandwidth.source.title and "500 W" in part.memory_bandwidth.source.title
    assert part.matmul_flops_per_s("bf16") == sxm.matmul_flops_per_s("bf16")
    assert "upper bound" in part.achievable_fraction["bf16"].note
    assert part.links == sxm.links


def test_the_network_is_a_stated_gb_s():
    """100 Gb/s / 8 = 12.5 GB/s; NCCL's network ring step: 9.6 us."""
    net = network_link(100)
    assert net.bandwidth_Bps == 12.5e9 and net.ring_step_latency_s == pytest.approx(9.6e-6)
    assert "stated" in net.bandwidth.source.title
    with pytest.raises(ProfileError, match="Gb/s"):
        network_link(0)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ProfileError, match="no device profile named 'h100'.*h100_sxm"):
        load_device("h100")
    with pytest.raises(ProfileError, match="no link profile"):
        load_link("a100_80gb")


def _broken(edit):
    data = copy.deepcopy(GOOD)
    edit(data)
    return data


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["memory_GB"].pop("source"), "memory_GB has no source"),
        (lambda d: d["peak_TFLOPs"]["bf16"].update(source="blog"), "names source 'blog'"),
        (lambda d: d["sources"]["sheet"].pop("url"), "needs a title and a url"),
        (lambda d: d.update(memory_GB=16), "memory_GB has no source"),
        (lambda d: d.update(fudge_factor={"value": 1.3, "source": "sheet"}), "unknown field"),
        (lambda d: d["achievable_fraction"]["bf16"].update(value=1.2), r"in \(0, 1\]"),
        (lambda d: d["peak_TFLOPs"].update(fp8={"value": 1, "source": "sheet"}), "'fp8' is not one of"),
        (lambda d: d.pop("memory_bandwidth_GBps"), "has no memory_bandwidth_GBps"),
        (
            lambda d: d.update(attention_fraction={"sideways": {"bf16": {"value": 0.5, "source": "sheet"}}}),
            "pass 'sideways' is not one of",
        ),
        (
            lambda d: d.update(attention_fraction={"forward": {"bf16": {"value": 1.5, "source": "sheet"}}}),
            r"attention_fraction.forward.bf16 must be in \(0, 1\]",
        ),
        (
            lambda d: d.update(attention_fraction={"forward": {"fp16": {"value": 0.5, "source": "sheet"}}}),
            "with a peak_TFLOPs.fp16",
        ),
        (lambda d: d.update(attention_fraction={"backward": {"bf16": {"value": 0.5}}}), "has no source"),
        (
            lambda d: d.update(memory_bandwidth_fraction={"value": 1.1, "source": "sheet"}),
            r"memory_bandwidth_fraction must be in \(0, 1\]",
        ),
        (
            lambda d: d.update(
                server_memory_bandwidth_GBps={"value": 0, "source": "sheet"},
                server_sockets={"value": 2, "source": "sheet"},
            ),
            "server_memory_bandwidth_GBps must be positive, not 0.0",
        ),
        (
            lambda d: d.update(
                server_memory_bandwidth_GBps={"value": 300}, server_sockets={"value": 2, "source": "sheet"}
            ),
            "server_memory_bandwidth_GBps has no source",
        ),
        (
            lambda d: d.update(server_memory_bandwidth_GBps={"value": 300, "source": "sheet"}),
            "gives server_memory_bandwidth_GBps without the other",
        ),
        (
            lambda d: d.update(
                server_memory_bandwidth_GBps={"value": 300, "source": "sheet"},
                server_sockets={"value": 1.5, "source": "sheet"},
            ),
            "server_sockets must be a whole number >= 1, not 1.5",
        ),
        (
            lambda d: d.update(
                server_memory_bandwidth_GBps={"value": 300, "source": "sheet"},
                server_sockets={"value": 2, "source": "sheet"},
                server_memory_GiB={"value": 0, "source": "sheet"},
            ),
            "server_memory_GiB must be positive, not 0.0",
        ),
        (
            lambda d: d.update(server_memory_GiB={"value": 1024, "source": "sheet"}),
            "gives server_memory_GiB without the server it belongs to",
        ),
    ],
)
def test_a_profile_breaking_the_rules_is_refused(edit, message):
    assert parse_device(GOOD).matmul_flops_per_s("bf16") == 80e12
    with pytest.raises(ProfileError, match=message):
        parse_device(_broken(edit))


def _link(link_class: str) -> dict:
    """A minimal link profile of the class, 10 GB/s a direction, every figure sourced."""
    return {
        "kind": "link", "name": "l", "class": link_class,
        "sources": {"s": {"title": "spec", "url": "https://example.org"}},
        "per_direction_GBps": {"value": 10, "source": "s"},
        "ring_step_latency_us": {"value": 1, "source": "s"}, "tree_step_latency_us": {"value": 1, "source": "s"},
    }  # fmt: skip


def test_a_link_gives_exactly_one_bandwidth():
    link = _link("pcie")
    assert parse_link(link).bandwidth_Bps == 10e9
    with pytest.raises(ProfileError, match="exactly one"):
        parse_link({**link, "total_bidirectional_GBps": {"value": 20, "source": "s"}})
    with pytest.raises(ProfileError, match="class"):
        parse_link({**link, "class": "carrier_pigeon"})


def test_an_attention_fraction_is_read_per_pass_and_absent_is_none():
    """0.5 forward and 0.25 backward of a 100 TFLOP/s peak; no fraction: None (a matmul then)."""
    data = copy.deepcopy(GOOD)
    data["attention_fraction"] = {"forward": {"bf16": {"value": 0.5, "source": "sheet"}},
                                  "backward": {"bf16": {"value": 0.25, "source": "sheet"}}}  # fmt: skip
    device = parse_device(data)
    assert device.attention_flops_per_s("forward", "bf16") == pytest.approx(50e12)
    assert device.attention_flops_per_s("backward", "bf16") == pytest.approx(25e12)
    assert parse_device(GOOD).attention_flops_per_s("forward", "bf16") is None


def test_a_measured_copy_fraction_scales_the_datasheet_bandwidth():
    """h200: 4,800 GB/s x 0.876 (the copy measured on one) = 4,204.8 GB/s; without one, the datasheet's."""
    assert load_device("h200").memory_bandwidth_Bps == pytest.approx(4204.8e9)
    assert parse_device(GOOD).memory_bandwidth_Bps == pytest.approx(1000e9)


def test_the_a100_and_h100_copy_fractions_are_azures_babelstream_copies():
    """Azure's BabelStream Copy: 1.61 of 2.039 TB/s on an A100-SXM4-80GB (0.790), 2.90 of 3.35
    on an H100 80GB HBM3 (0.866); GPUInspector.jl's 0.5 GiB copy on an A100-SXM4-40GB: 1,310.7
    of 1,555 GB/s (0.843). torchtitan's HBM2e H100 was not measured: it keeps the datasheet's
    whole (an upper bound)."""
    assert load_device("a100_80gb").memory_bandwidth_Bps == pytest.approx(2039e9 * 0.790)
    assert load_device("h100_sxm").memory_bandwidth_Bps == pytest.approx(3350e9 * 0.866)
    assert load_device("a100_40gb").memory_bandwidth_Bps == pytest.approx(1555e9 * 0.843)
    assert "BabelStream Copy" in load_device("h100_sxm").memory_bandwidth_fraction.note
    assert load_device("h100_hbm2e_500w").memory_bandwidth_fraction is None


def test_a_stated_bus_bandwidth_fraction_scales_the_line_rate():
    """NVLink 4: 450 GB/s a direction x 0.822 (NCCL's 370 GB/s busBw) = 369.9 GB/s; NVLink 3:
    300 x 0.772 (Azure's 231.58 GB/s on 8 A100) = 231.6; PCIe 4 has none, its line rate whole.
    A fraction outside (0, 1] is refused."""
    assert load_link("nvlink4").bandwidth_Bps == pytest.approx(369.9e9)
    assert load_link("nvlink3").bandwidth_Bps == pytest.approx(231.6e9)
    assert load_link("pcie4").bus_bandwidth_fraction is None and load_link("pcie4").bandwidth_Bps == 31.5e9
    link = _link("nvlink")
    assert parse_link({**link, "bus_bandwidth_fraction": {"value": 0.5, "source": "s"}}).bandwidth_Bps == 5e9
    with pytest.raises(ProfileError, match=r"bus_bandwidth_fraction must be in \(0, 1\]"):
        parse_link({**link, "bus_bandwidth_fraction": {"value": 1.2, "source": "s"}})
    with pytest.raises(ProfileError, match="has no source"):
        parse_link({**link, "bus_bandwidth_fraction": {"value": 0.5}})


def test_the_reference_servers_host_memory_is_shared_by_the_ranks_stepping_on_it():
    """The host memory of the server a node of each GPU comes in, its DIMMs' peak (channels x
    MT/s x 8 bytes x 2 sockets): DGX H100 and H200, 2 Xeon 8480C with 8 channels of DDR5 at
    4400 MT/s (two DIMMs a channel): 563.2 GB/s; DGX A100, 2 EPYC 7742 at 204.8 each: 409.6;
    DGX-1, 2 Xeon E5-2698 v4 with 4 channels of 2133 MT/s DIMMs: 136.5. An in-place update
    moves at the peak, a copy at 2/3 of it (its destination read before written). Each socket
    serves the GPUs attached to it, filled in order: at 8 ranks on an H100 node each of a
    socket's 4 ranks gets 281.6 / 4 = 70.4 GB/s; at 4 ranks (GPUs 0-3, one socket) the same;
    at 2, 140.8; alone, the socket's 281.6. Torchtitan's Grand Teton H100 states none."""
    h100 = load_device("h100_sxm").host_memory
    assert h100.per_rank(8, 8) == pytest.approx((70.4e9 * 2 / 3, 70.4e9))
    assert h100.per_rank(4, 8) == h100.per_rank(8, 8)
    assert h100.per_rank(2, 8)[1] == pytest.approx(140.8e9) and h100.per_rank(1, 8)[1] == pytest.approx(281.6e9)
    assert load_device("h200").host_memory.per_rank(8, 8) == h100.per_rank(8, 8)
    assert load_device("a100_40gb").host_memory.per_rank(8, 8)[1] == pytest.approx(51.2e9)
    assert load_device("a100_80gb").host_memory.in_place.value == load_device("a100_40gb").host_memory.in_place.value
    assert load_device("v100_32gb").host_memory.per_rank(8, 8)[1] == pytest.approx(136.5e9 / 8)
    assert load_device("h100_hbm2e_500w").host_memory is None
    assert parse_device(GOOD).host_memory is None


def test_each_reference_servers_memory_is_its_sourced_dimms():
    """What CPU offload's node is held against (plan.host_memory_gib's default): a DGX's DIMMs,
    in GiB (a 64 GB DIMM holds 64 GiB); none for torchtitan's Grand Teton hosts (not stated)."""
    named = ("v100_32gb", "a100_40gb", "a100_80gb", "h100_sxm", "h200")
    capacity = {n: load_device(n).host_memory.capacity_gib for n in named}
    assert {n: f.value for n, f in capacity.items()} == {
        "v100_32gb": 512.0, "a100_40gb": 1024.0, "a100_80gb": 2048.0, "h100_sxm": 2048.0, "h200": 2048.0,
    }  # fmt: skip
    assert all(f.source.url for f in capacity.values())
