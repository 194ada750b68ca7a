"""The planner: the same config tree and the same fake step as every run's prediction."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_job

GIB, MIB = 2**30, 2**20
TWO_STEPS = ["trainer.steps=3", "trainer.warmup_steps=2", "trainer.eval_batches=0"]


def plan_json(*overrides: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "sharded_exp.plan", "plan.format=json", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_raw_count_is_an_ideally_divisible_model():
    """7.5e9 parameters, 64 ranks, precision 16, Adam: torch AMP keeps fp32 parameters and
    gradients (4 + 4 bytes) and Adam's two fp32 moments (8 bytes), sharded or not."""
    plan = plan_json("plan.params=7.5e9", "plan.world_sizes=[64]", "precision=16", "optimizer=adam")
    rows = {r["strategy"]: r for r in plan["rows"]}
    gb = lambda r, *parts: sum(r[f"{p}_gib"] for p in parts) * GIB / 1e9  # noqa: E731
    states = ("params", "grads", "optimizer")
    assert all(r["method"].startswith("raw parameter count") and r["activations_gib"] is None for r in rows.values())
    assert gb(rows["ddp"], *states) == pytest.approx(120.0, rel=1e-3)
    for zero1 in ("oss", "zero1"):  # 8 + 8/64 bytes per parameter
        assert gb(rows[zero1], *states) == pytest.approx(60.94, rel=1e-3)
    # ShardedDDP: 4 + 12/64 bytes, plus reduce buckets kept for every destination rank
    buckets = gb(rows["sharded_ddp"], *states) - 31.41
    assert 0 < buckets <= 64 * 2**23 * 4 / 1e9
    assert gb(rows["fsdp"], *states) == pytest.approx(1.875, rel=1e-3)
    # gathered at the peak: one of 32 units (ZeRO-3), or every parameter (ZeRO-2), in fp16
    assert gb(rows["fsdp"], "gathered") == pytest.approx(7.5e9 / 32 * 2 / 1e9, rel=1e-3)
    assert gb(rows["fsdp_grad_op"], "gathered") == pytest.approx(7.5e9 * 2 / 1e9, rel=1e-3)
    assert rows["ddp"]["total_gib"] > rows["oss"]["total_gib"] > rows["sharded_ddp"]["total_gib"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "sharded_ddp", "fsdp"])
def test_plan_is_the_runs_prediction(strategy, tmp_path):
    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=64"]
    result = run_job([f"strategy={strategy}", *model], tmp_path)
    plan = plan_json(*model, "trainer.batch_size=8", "plan.world_sizes=[2]", f"plan.strategies=[{strategy}]")
    (row,) = plan["rows"]
    mem = result["memory"]
    assert row["total_gib"] * GIB / MIB == pytest.approx(mem["predicted_peak_mib_max"], rel=1e-4)
    assert row["model_states_gib"] * GIB / MIB == pytest.approx(mem["predicted_model_states_mib_max"], rel=1e-9)


def test_largest_batch_that_fits_is_checked_by_real_runs(tmp_path):
    """plan.find=batch_size under a budget; a real run at that batch stays within it, one
    sample more goes over (the CPU tracker enforces trainer.memory_limit_mib)."""
    model = ["model=gpt", "model.d_model=32", "model.n_heads=2", "model.seq_len=32", "model.vocab_size=256"]
    budget_mib = 24
    plan = plan_json(
        *model, "plan.world_sizes=[2]", "plan.strategies=[fsdp]", "plan.find=batch_size",
        f"plan.device_memory_gib={budget_mib / 1024}",
    )  # fmt: skip
    (found,) = plan["found"]
    batch = found["value"]
    assert batch >= 2, found
    runs = {}
    for b in (batch, batch + 1):
        runs[b] = run_job(
            [*model, "strategy=fsdp", f"trainer.batch_size={b}", f"trainer.memory_limit_mib={budget_mib}",
             *TWO_STEPS], tmp_path / str(b),
        )  # fmt: skip
    assert runs[batch]["status"] == "ok", runs[batch].get("error")
    assert runs[batch + 1]["status"] == "oom", runs[batch + 1].get("error")


@pytest.mark.slow
def test_7b_plan_point_is_fast_and_allocates_nothing():
    code = (
        "import resource, sys, time; t = time.perf_counter(); from sharded_exp.plan import main; "
        "main(['model=gpt_7b', 'trainer.batch_size=1', 'plan.format=json', 'plan.world_sizes=[8]', "
        "'plan.strategies=[ddp,fsdp]']); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds, max_rss_kib = proc.stderr.strip().splitlines()[-1].split()
    plan = json.loads(proc.stdout)
    assert plan["params"] > 6.5e9
    # A guard against a hang or a real allocation, not the speed target (benchmarks/ and
    # the closing note time it): two fake steps of a 7B model per point.
    assert int(max_rss_kib) < 2 * 1024 * 1024  # peak RSS under 2 GiB: nothing was allocated
    rows = {r["strategy"]: r for r in plan["rows"]}
    assert rows["ddp"]["method"] == rows["fsdp"]["method"] == "fake step"
    assert not rows["ddp"]["fits"] and rows["fsdp"]["fits"]
    # FSDP holds an eighth of the 16 bytes per parameter of model states
    assert math.isclose(rows["fsdp"]["model_states_gib"] * 8, rows["ddp"]["model_states_gib"], rel_tol=0.01)
