"""The this profile: built from cached measurements (measuring itself starts processes: the
integration tier runs it)."""

from __future__ import annotations

import json

import pytest

from sharded_exp.measure import machine


def test_the_profile_is_built_from_the_cache_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = {"matmul": {"fp32": [[1e6, 0.01], [1e9, 0.05]]}, "memory_bandwidth_GBps": 10.0, "op_overhead_s": 5e-6,
               "link": {"bandwidth_GBps": 0.5, "step_latency_us": 100.0}, "measured_at": "then"}  # fmt: skip
    path = tmp_path / "sharded_exp" / "this_profile.json"
    path.parent.mkdir()
    path.write_text(json.dumps({machine._key(3): figures}))
    monkeypatch.setattr(machine, "measure", lambda threads: pytest.fail("measured although cached"))
    device, link = machine.this_profile(3)
    assert device.name == "this" and device.op_overhead_s == 5e-6 and device.memory_bandwidth_Bps == 10e9
    assert device.peak_flops_per_s("fp32") == 0.05e12 and device.curve("matmul", "fp32").points[0] == (1e6, 0.01)
    assert link.bandwidth_Bps == 0.5e9 and link.ring_step_latency_s == pytest.approx(1e-4)


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
