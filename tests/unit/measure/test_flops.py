"""sharded_exp.measure.flops: GPU peaks matched by model name, the CPU's measured matmul
peak (its formula and its cache), which peak a device gets, and the MFU fields."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from sharded_exp.measure import flops
from sharded_exp.measure.flops import TERA, cpu_peak, device_peak, gpu_peak, measure_cpu_matmul, utilisation


# -------------------------------------------------------------------------- gpu_peak
@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),  # SXM names no form factor
        ("NVIDIA H100 PCIe", "16", 756),
        ("NVIDIA H100 NVL", "bf16", 835),
        ("NVIDIA H200 NVL", "32", 60),
        ("NVIDIA H200", "32", 67),
        ("NVIDIA GH200 480GB", "bf16", 989),
        ("NVIDIA A100-SXM4-80GB", "32", 19.5),  # a hyphen separates words too
        ("NVIDIA A100 80GB PCIe", "bf16", 312),
    ],
)
def test_gpu_peaks_come_from_the_table_by_whole_words(name, precision, tflops):
    peak, source = gpu_peak(name, precision)
    assert peak == pytest.approx(tflops * TERA)
    assert source == f"table: {name}, dense {precision}"


@pytest.mark.parametrize("name", ["NVIDIA H1000", "Tesla V100-SXM2-16GB", "NVIDIA XH100"])
def test_an_unknown_device_has_no_peak_and_says_so(name):
    assert gpu_peak(name, "bf16") == (None, f"unknown device {name!r}: no peak")


def test_a_mig_slice_has_no_peak():
    peak, source = gpu_peak("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16")
    assert peak is None and "MIG slice" in source


def test_a_precision_given_as_a_number_is_read_as_its_name():
    assert gpu_peak("NVIDIA A100", 32)[0] == pytest.approx(19.5 * TERA)


# ---------------------------------------------------------------- measure_cpu_matmul
def test_the_cpu_matmul_rate_is_2n3_flops_per_product_over_the_elapsed_time(monkeypatch):
    clock = iter(range(100))  # each read one second later: t0 = 0, reads 1..4 run, 5 stops, 6 ends
    monkeypatch.setattr(flops, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    products = []
    real_mm = torch.mm
    monkeypatch.setattr(flops.torch, "mm", lambda a, b: products.append(a.dtype) or real_mm(a, b))
    rate = measure_cpu_matmul(torch.float32, n=8, seconds=5)
    assert len(products) == 1 + 4  # the warm-up, then four timed
    assert rate == pytest.approx(2 * 8**3 * 4 / 6)


# ------------------------------------------------------------------------- cpu_peak
@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "sharded_exp" / "cpu_matmul_peak.json"


def test_the_cache_lives_under_xdg_cache_home(cache_home):
    assert flops._cache_path() == str(cache_home)


def test_a_first_call_measures_and_caches_then_reads_the_cache(cache_home, monkeypatch):
    measured = []
    monkeypatch.setattr(flops, "measure_cpu_matmul", lambda dtype: measured.append(dtype) or 5e9)
    assert cpu_peak("32") == 5e9
    assert measured == [torch.float32]
    cache = json.loads(cache_home.read_text())
    [(key, value)] = cache.items()
    assert value == 5e9
    assert f"threads={torch.get_num_threads()}" in key and key.endswith("torch.float32")
    assert cpu_peak("32") == 5e9 and len(measured) == 1  # read, not measured again
    assert not [f for f in os.listdir(cache_home.parent) if f != cache_home.name]  # no temporary left


def test_a_cached_peak_is_kept_per_dtype(cache_home, monkeypatch):
    rates = iter([5e9, 2e9])
    monkeypatch.setattr(flops, "measure_cpu_matmul", lambda dtype: next(rates))
    assert cpu_peak("32") == 5e9
    assert cpu_peak("bf16") == 2e9  # bfloat16: another key, measured on its own
    assert len(json.loads(cache_home.read_text())) == 2


@pytest.mark.parametrize("content", ["not json", "[1, 2]", None])
def test_a_broken_or_foreign_cache_is_measured_again(cache_home, monkeypatch, content):
    cache_home.parent.mkdir(parents=True)
    if content is None:  # a cache whose entry for this key is not a number
        from sharded_exp.measure.flops import platform

        key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|threads={torch.get_num_threads()}|torch.float32"
        content = json.dumps({key: "fast", "other": 1.0})
    cache_home.write_text(content)
    monkeypatch.setattr(flops, "measure_cpu_matmul", lambda dtype: 7e9)
    assert cpu_peak("32") == 7e9
    assert 7e9 in json.loads(cache_home.read_text()).values()


# ---------------------------------------------------------------------- device_peak
def test_a_cpu_has_a_measured_peak_at_fp32_only(monkeypatch):
    monkeypatch.setattr(flops, "cpu_peak", lambda precision: 3e9)
    peak, source = device_peak(torch.device("cpu"), 32)
    assert peak == 3e9 and source.startswith("measured: matmul on this CPU")
    assert device_peak(torch.device("cpu"), "bf16") == (None, "no trustworthy CPU peak at precision bf16")


def test_a_cpu_runs_mfu_divides_by_the_peak_its_prediction_divided_by(monkeypatch):
    """The run's step-time prediction divided by its this profile's best matmul (the planner's
    MFU peak); the run's mfu_pct uses that figure, not a matmul of its own (they were 12% apart)."""
    monkeypatch.setattr(flops, "cpu_peak", lambda precision: pytest.fail("measured although the prediction had one"))
    peak, source = device_peak(torch.device("cpu"), 32, predicted=2e11)
    assert peak == 2e11 and "the best size of the `this` profile" in source
    assert utilisation(1e9, 0.01, torch.device("cpu"), "32", predicted_peak=2e11)["mfu_pct"] == pytest.approx(50)
    assert device_peak(torch.device("cpu"), "bf16", predicted=2e11)[0] is None  # fp32 only, as before


@pytest.fixture
def tf32():
    """Sets torch's TF32 matmul flag (a property monkeypatch cannot undo), restored after."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32

    def set_to(value: bool) -> None:
        matmul.allow_tf32 = value

    yield set_to
    matmul.allow_tf32 = saved


def test_a_cuda_device_reads_the_table_unless_tf32_is_on(monkeypatch, tf32):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    tf32(False)
    assert device_peak(torch.device("cuda", 0), "32")[0] == pytest.approx(67 * TERA)
    tf32(True)
    peak, source = device_peak(torch.device("cuda", 0), "32")
    assert peak is None and "TF32" in source
    assert device_peak(torch.device("cuda", 0), "bf16")[0] == pytest.approx(989 * TERA)  # TF32 is fp32's only


# ---------------------------------------------------------------------- utilisation
def test_utilisation_is_achieved_flops_over_the_peak_in_percent(monkeypatch):
    monkeypatch.setattr(flops, "device_peak", lambda device, precision, predicted=None: (1e12, "table: X"))
    out = utilisation(2e11, 0.5, torch.device("cpu"), "32")
    assert out == {
        "model_flops_per_step_per_rank": 2e11,
        "achieved_flops_per_s": 4e11,
        "peak_flops_per_s": 1e12,
        "peak_flops_source": "table: X",
        "mfu_pct": pytest.approx(40.0),
    }


def test_without_flops_or_a_step_time_there_is_no_utilisation(monkeypatch):
    monkeypatch.setattr(flops, "device_peak", lambda *a: pytest.fail("no peak is needed"))
    for flops_per_step, step_time in [(None, 1.0), (0, 1.0), (100, None), (100, 0.0)]:
        out = utilisation(flops_per_step, step_time, torch.device("cpu"), "32")
        assert out == {"model_flops_per_step_per_rank": flops_per_step, "achieved_flops_per_s": None, "mfu_pct": None}


def test_an_mfu_above_100_percent_is_null_and_the_peak_not_trusted(monkeypatch):
    monkeypatch.setattr(flops, "device_peak", lambda device, precision, predicted=None: (1e12, "measured: x"))
    out = utilisation(3e12, 1.0, torch.device("cpu"), "32")
    assert out["mfu_pct"] is None and out["achieved_flops_per_s"] == 3e12
    assert out["peak_flops_source"] == "measured: x; achieved 3 TFLOP/s is above it: peak not trusted"
    exactly = utilisation(1e12, 1.0, torch.device("cpu"), "32")  # 100% is possible, not above
    assert exactly["mfu_pct"] == pytest.approx(100.0)


def test_a_device_without_a_peak_has_no_mfu_but_its_reason(monkeypatch):
    monkeypatch.setattr(flops, "device_peak", lambda device, precision, predicted=None: (None, "unknown device"))
    out = utilisation(1e9, 1.0, torch.device("cpu"), "32")
    assert out["mfu_pct"] is None and out["peak_flops_source"] == "unknown device" and out["peak_flops_per_s"] is None
