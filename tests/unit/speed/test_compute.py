"""Op timing against hand-worked numbers, and aten ops classified."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharded_exp.errors import ConfigError
from sharded_exp.speed.compute import Op, achieved_flops_per_s, classify, compute_time, op_time, ops_from_records
from sharded_exp.speed.profiles import Curve, ProfileError, load_device, parse_device

H100 = load_device("h100_sxm")


def _device_with_curve():
    src = {"m": {"title": "a test measurement", "url": "https://example.org/m"}}
    return parse_device({
        "kind": "device", "name": "curved", "sources": src,
        "memory_GB": {"value": 1, "source": "m"}, "memory_bandwidth_GBps": {"value": 1000, "source": "m"},
        "peak_TFLOPs": {"bf16": {"value": 1000, "source": "m"}},
        "curves": {"matmul": {"bf16": {"points": [[1e12, 100], [1e9, 10]], "source": "m"}}},
    })  # fmt: skip


def test_a_large_matmul_is_compute_bound_at_the_measured_rate():
    """H100 bf16: 989 TFLOP/s * 0.801 (MAMF) = 792.19 TFLOP/s; 1e12 FLOPs take 1.2623 ms
    (1 MB moved takes 0.34 us at 3.35 TB/s x 0.866, the copy Azure's BabelStream reached)."""
    assert op_time(Op("matmul", 1e12, 1e6, "bf16"), H100) == pytest.approx(1e12 / 792.189e12)
    assert op_time(Op("matmul", 1e12, 1e6, "bf16"), H100) == pytest.approx(1.2623e-3, rel=1e-4)


def test_a_thin_matmul_is_memory_bound_and_other_ops_always_are():
    """1e9 FLOPs but 1e10 bytes: 1e10 / (3.35e12 x 0.866 = 2.9011e12) = 3.447 ms > 1.26 us of
    math; the copy's fraction is the BabelStream Copy Azure measured on an H100 80GB HBM3."""
    assert op_time(Op("matmul", 1e9, 1e10, "bf16"), H100) == pytest.approx(1e10 / 2.9011e12)
    assert op_time(Op("other", 1e12, 2.9011e9, "bf16"), H100) == pytest.approx(1e-3)


def test_without_a_published_fraction_the_peak_is_used():
    """V100 has no MAMF row: fp16 1e12 / 125e12 = 8 ms."""
    assert op_time(Op("attention", 1e12, 0, "fp16"), load_device("v100_32gb")) == pytest.approx(1e12 / 125e12)


def test_fused_attention_is_priced_at_the_published_fraction_of_its_pass():
    """A100 80GB (FlashAttention-2 paper): forward 0.73 x 312 = 227.76 TFLOP/s, backward
    0.63 x 312 = 196.56; a causal call does half the FLOPs counted: 1e12 / 2 / 227.76e12."""
    a100 = load_device("a100_80gb")
    assert op_time(Op("attention", 1e12, 0, "bf16", "attention.forward"), a100) == pytest.approx(1e12 / 227.76e12)
    assert op_time(Op("attention", 1e12, 0, "bf16", "attention.backward"), a100) == pytest.approx(1e12 / 196.56e12)
    causal = Op("attention", 1e12, 0, "bf16", "aten._scaled_dot_product_flash_attention.default", causal=True)
    assert op_time(causal, a100) == pytest.approx(0.5e12 / 227.76e12)
    # slower than a matmul of the same FLOPs at the MAMF rate (0.859 x 312)
    assert op_time(Op("attention", 1e12, 0, "bf16"), a100) > op_time(Op("matmul", 1e12, 0, "bf16"), a100)


def test_a_measured_curve_is_read_in_log_space_and_clamped():
    """Points (1e9 FLOPs, 10 TFLOP/s) and (1e12, 100): at 10^10.5 FLOPs, halfway in log,
    10^1.5 = 31.62 TFLOP/s, so 10^10.5 / 10^13.5 = 1 ms. Below the first point: its rate,
    1e8 / 10e12 = 10 us."""
    device = _device_with_curve()
    assert achieved_flops_per_s(device.curve("matmul", "bf16"), 10**10.5) == pytest.approx(10**13.5)
    assert op_time(Op("matmul", 10**10.5, 0, "bf16"), device) == pytest.approx(1e-3)
    assert op_time(Op("matmul", 1e8, 0, "bf16"), device) == pytest.approx(1e-5)
    assert op_time(Op("matmul", 1e14, 0, "bf16"), device) == pytest.approx(1.0)


def test_an_attention_curve_is_a_causal_calls_and_a_call_that_is_not_runs_twice_the_flops():
    """The ``this`` profile measures causal calls, the FLOPs counted over the whole square
    (a causal kernel runs half of them): 1e12 counted FLOPs on a flat 10 TFLOP/s curve take
    0.1 s causal, 0.2 s not (every FLOP counted is run). It priced both at 0.1 s."""
    plain = _device_with_curve()
    flat = Curve(((1e6, 10.0), (1e14, 10.0)), plain.curve("matmul", "bf16").source, causal_calls=True)
    device = replace(plain, curves={**plain.curves, ("attention", "bf16"): flat})
    assert op_time(Op("attention", 1e12, 0, "bf16", "attention.forward", causal=True), device) == pytest.approx(0.1)
    assert op_time(Op("attention", 1e12, 0, "bf16", "attention.forward"), device) == pytest.approx(0.2)
    # a matmul's curve standing in for attention's (a dtype attention was not measured in) is no causal curve
    stand_in = replace(plain, curves={**plain.curves, ("attention", "bf16"): replace(flat, causal_calls=False)})
    assert op_time(Op("attention", 1e12, 0, "bf16", "attention.forward"), stand_in) == pytest.approx(0.1)


def test_a_dtype_the_device_has_no_figure_for_is_refused_by_name():
    with pytest.raises(ProfileError, match=r"v100_32gb.*'bf16'.*fp16, fp32"):
        op_time(Op("matmul", 1e12, 0, "bf16"), load_device("v100_32gb"))
    with pytest.raises(ConfigError, match="op kind"):
        Op("conv", 1, 1, "bf16")


@pytest.mark.parametrize(
    "name, kind",
    [("aten.mm.default", "matmul"), ("aten::addmm", "matmul"), ("torch.ops.aten.bmm.default", "matmul"),
     ("baddbmm", "matmul"), ("aten.convolution.default", "matmul"),
     ("aten._scaled_dot_product_flash_attention.default", "attention"),
     ("aten._scaled_dot_product_efficient_attention_backward.default", "attention"),
     ("attention.forward", "attention"), ("attention.backward", "attention"),
     ("aten.add.Tensor", "other"), ("aten.gelu.default", "other"), ("aten._softmax.default", "other")],
)  # fmt: skip
def test_aten_ops_are_classified(name, kind):
    assert classify(name) == kind


def test_flop_counter_records_become_ops():
    """mm: 2 * 64 * 128 * 256 = 4,194,304 FLOPs; bytes = inputs + outputs."""
    records = [
        {"op": "aten.mm.default", "flops": 4194304, "input_bytes": 81920, "output_bytes": 32768},
        {"op": "aten.add.Tensor", "flops": 0, "input_bytes": 200, "output_bytes": 100, "dtype": "fp32"},
        {"op": "attention.backward", "flops": 10, "input_bytes": 6, "output_bytes": 6, "causal": True},
    ]
    mm, add, attention = ops_from_records(records, "bf16")
    assert (attention.kind, attention.causal, attention.backward, mm.causal) == ("attention", True, True, False)
    assert (mm.kind, mm.flops, mm.bytes_moved, mm.dtype) == ("matmul", 4194304, 114688, "bf16")
    assert (add.kind, add.bytes_moved, add.dtype) == ("other", 300, "fp32")
    assert compute_time([mm, add], H100) == pytest.approx(op_time(mm, H100) + 300 / 2.9011e12)
    with pytest.raises(ConfigError, match="output_bytes"):
        ops_from_records([{"op": "aten.mm.default", "flops": 1, "input_bytes": 1}], "bf16")


def _device_with_elementwise_rates(rates):
    src = {"m": {"title": "a test measurement", "url": "https://example.org/m"}}
    plain = parse_device({
        "kind": "device", "name": "cpu-like", "sources": src,
        "memory_GB": {"value": 1, "source": "m"}, "memory_bandwidth_GBps": {"value": 10, "source": "m"},
        "peak_TFLOPs": {"fp32": {"value": 1, "source": "m"}},
    })  # fmt: skip
    return replace(plain, elementwise_Bps=rates)


def test_an_elementwise_op_measured_slower_than_its_bytes_takes_its_own_rate():
    """1e9 bytes of GELU: 0.1 s at the copy's 10 GB/s, 0.5 s at GELU's measured 2 GB/s; the
    in-place variant is GELU's; exp measured faster than a copy stays at the copy's pace; bf16
    was not measured, nor was add: both by their bytes."""
    device = _device_with_elementwise_rates({("gelu", "fp32"): 2e9, ("exp", "fp32"): 50e9})
    assert op_time(Op("other", 0, 1e9, "fp32", "aten.gelu.default"), device) == pytest.approx(0.5)
    assert op_time(Op("other", 0, 1e9, "fp32", "aten.gelu_.default"), device) == pytest.approx(0.5)
    assert op_time(Op("other", 0, 1e9, "fp32", "aten.exp.default"), device) == pytest.approx(0.1)
    assert op_time(Op("other", 0, 1e9, "bf16", "aten.gelu.default"), device) == pytest.approx(0.1)
    assert op_time(Op("other", 0, 1e9, "fp32", "aten.add.Tensor"), device) == pytest.approx(0.1)
    assert not H100.elementwise_Bps  # a named GPU has none: every such op by its bytes, as before


def test_a_matmul_is_priced_on_the_curve_of_its_layout_where_the_profile_has_one():
    """The matmul curve runs at 10-100 TFLOP/s; the tn curve at a flat 1 TFLOP/s: 1e12 FLOPs
    of tn take 1 s; an nt matmul (no curve), one without a layout, and a tn matmul in a dtype
    without a layout curve are priced on the matmul curve (1e12 FLOPs at 100 TFLOP/s: 10 ms)."""
    plain = _device_with_curve()
    src = plain.curve("matmul", "bf16").source
    device = replace(plain, layout_curves={("tn", "bf16"): Curve(((1e6, 1.0), (1e12, 1.0)), src)})
    assert op_time(Op("matmul", 1e12, 0, "bf16", layout="tn"), device) == pytest.approx(1.0)
    for op in (Op("matmul", 1e12, 0, "bf16", layout="nt"), Op("matmul", 1e12, 0, "bf16")):
        assert op_time(op, device) == pytest.approx(1e-2)
    records = [{"op": "aten.mm.default", "flops": 1e12, "input_bytes": 0, "output_bytes": 0, "layout": "tn"}]
    (op,) = ops_from_records(records, "bf16")
    assert op.layout == "tn" and op_time(op, device) == pytest.approx(1.0)
