"""sharded_exp.report.planned: a CPU point's speed priced on the sweep's GPU profile
(``report.device_profile``) by the planner's functions, or the reason it has none."""

from __future__ import annotations

import copy
import functools

import pytest
from omegaconf import OmegaConf

import sharded_exp.plan.speed
from sharded_exp.compose import compose
from sharded_exp.report.planned import add_planned, profile_of
from sharded_exp.report.rows import build_rows
from tests.helpers.unit_output import point

CPU = {"type": "cpu", "threads_per_rank": 1}


@functools.cache
def _composed(profile: str | None, strategy: str) -> dict:
    cfg = compose([f"strategy={strategy}", "model.hidden=32", "model.depth=2", "logger=none"])
    cfg.report.device_profile = profile
    return OmegaConf.to_container(cfg, resolve=True)


def _config(profile: str | None = "h100_sxm", strategy: str = "ddp") -> dict:
    """A point's resolved config (result.json's ``config``), a fresh copy."""
    return copy.deepcopy(_composed(profile, strategy))


def test_the_profile_is_read_from_the_points_configs():
    assert profile_of([point("ddp", config=_config("h200"))]) == "h200"
    assert profile_of([point("ddp", config=_config(None))]) is None
    assert profile_of([point("ddp")]) is None  # an older result.json: no report section


def test_a_sweep_without_a_profile_gets_no_planned_figures():
    rows = build_rows(points := [point("ddp", peak=1.0, sps=10.0, device=CPU, config=_config(None))])
    add_planned(rows, points)
    assert "_planned" not in rows[0]


def test_each_cpu_point_is_priced_at_its_world_size_with_one_trace_per_config(monkeypatch):
    calls = []
    real = sharded_exp.plan.speed.traced
    monkeypatch.setattr(sharded_exp.plan.speed, "traced", lambda *a: calls.append(a) or real(*a))
    points = [
        point("ddp", 1, n=0, peak=1.0, sps=10.0, device=CPU, config=_config()),
        point("ddp", 2, n=1, peak=1.0, sps=10.0, device=CPU, config=_config()),
        point("fsdp", 2, n=2, peak=0.5, sps=5.0, device=CPU, config=_config(strategy="fsdp")),
        point("oss", 2, n=3, status="oom", device=CPU, config=_config(strategy="oss")),
    ]
    rows = {(r["strategy"], r["world_size"]): r for r in build_rows(points)}
    add_planned(list(rows.values()), points)
    assert len(calls) == 2  # ddp at 1 and 2 ranks share one trace; fsdp has its own
    for key in (("ddp", 1), ("ddp", 2), ("fsdp", 2)):
        planned = rows[key]["_planned"]
        assert planned["profile"] == "h100_sxm" and planned["step_time_s"] > 0 and planned["note"] is None, key
    assert rows[("ddp", 2)]["_planned"]["step_time_s"] > rows[("ddp", 1)]["_planned"]["step_time_s"]  # + all-reduce
    assert "_planned" not in rows[("oss", 2)]  # out of memory: no speed to compare


def test_a_point_that_cannot_be_priced_says_why_and_the_report_goes_on(monkeypatch):
    def broken(*_):
        raise RuntimeError("no kernels for this\nsecond line")

    monkeypatch.setattr(sharded_exp.plan.speed, "traced", broken)
    points = [point("ddp", peak=1.0, sps=10.0, device=CPU, config=_config()),
              point("fsdp", n=1, peak=1.0, sps=10.0, device=CPU, config={"report": {"device_profile": "h100_sxm"}}),
              point("zero1", n=2, peak=1.0, sps=10.0, device={"type": "cuda"}, config=_config())]  # fmt: skip
    rows = {r["strategy"]: r for r in build_rows(points)}
    add_planned(list(rows.values()), points)
    assert rows["ddp"]["_planned"] == {"profile": "h100_sxm", "step_time_s": None,
                                       "note": "RuntimeError: no kernels for this"}  # fmt: skip
    assert rows["fsdp"]["_planned"]["note"].startswith("its result.json has no strategy, precision, model")
    assert rows["zero1"]["_planned"]["note"] == "it ran on a GPU"


@pytest.mark.parametrize("profile", ["h200", "v100_32gb"])
def test_a_named_profile_is_what_the_planner_prices_on(profile):
    from sharded_exp.report.planned import plan_config

    cfg = plan_config(_config(profile), profile)
    assert cfg.plan.device_profile == profile and str(cfg.plan.device) == "cuda" and cfg.strategy.name == "ddp"
