"""Speed figures with their noise: every step time kept, the median's 95% interval, speed
ratios with theirs, "within noise" where the interval holds 1.0, and the machine's load."""

from __future__ import annotations

import json
import random

import pytest

from sharded_exp.report.rows import build_rows
from sharded_exp.report.text import headline, speed_notes
from sharded_exp.train.metrics import median_ci95, throughput_stats
from tests.helpers.jobs import ROOT, TINY, run_cli


def test_the_medians_interval_comes_from_order_statistics_and_covers_it():
    assert median_ci95([1.0] * 5) is None  # too few steps for any 95% interval
    assert median_ci95([float(x) for x in range(1, 7)]) == (1.0, 6.0)
    assert median_ci95([float(x) for x in range(1, 21)]) == (6.0, 15.0)  # the textbook ranks for n=20
    rng = random.Random(0)
    covered = sum(
        lo <= 0.693 <= hi for lo, hi in (median_ci95([rng.expovariate(1) for _ in range(15)]) for _ in range(2000))
    )
    assert covered / 2000 >= 0.95  # skewed, like step times: still at least 95%


def test_throughput_keeps_every_step_time_and_the_interval():
    times = [0.01 * (1 + (i % 5) / 10) for i in range(12)]
    stats = throughput_stats(times, samples_per_step=32, tokens_per_step=0, loop_time_s_per_step=None)
    assert stats["step_times_s"] == times and stats["timed_steps"] == 12
    low, high = stats["step_time_s_ci95_low"], stats["step_time_s_ci95_high"]
    assert low <= stats["step_time_s_median"] <= high
    assert stats["samples_per_s_ci95_low"] == pytest.approx(32 / high)
    assert stats["samples_per_s_ci95_high"] == pytest.approx(32 / low)


def _point(n: int, seed: int, samples: float, spread: float, load: float = 0.5, strategy: str = "ddp") -> dict:
    return {"status": "ok", "strategy": strategy, "world_size": 2, "precision": "32", "model": "mlp",
            "output_dir": f"/s/{n}_seed{seed}", "overrides": [f"strategy={strategy}", f"trainer.seed={seed}"],
            "device": {"type": "cpu", "threads_per_rank": 1},
            "throughput": {"samples_per_s": samples, "samples_per_s_ci95_low": samples * (1 - spread),
                           "samples_per_s_ci95_high": samples * (1 + spread), "timed_steps": 20,
                           "load_avg_1m": load, "cpu_count": 2},
            "memory": {"peak_allocated_mib_max": 10.0}}  # fmt: skip


def test_a_repeat_within_its_interval_reads_within_noise_and_a_slowed_one_does_not():
    rows = {r["_dir"]: r for r in build_rows([_point(0, 1, 100.0, 0.1), _point(1, 2, 104.0, 0.1),
                                              _point(2, 3, 40.0, 0.05, load=3.5)])}  # fmt: skip
    first, repeat, slowed = rows["point 0"], rows["point 1"], rows["point 2"]
    assert repeat["_base"] is first and slowed["_base"] is first  # repeats of one setting: the first is the baseline
    assert repeat["speed_within_noise"] is True
    assert repeat["speed_vs_baseline_ci95_low"] == pytest.approx(93.6 / 110)
    assert repeat["speed_vs_baseline_ci95_low"] < 1 < repeat["speed_vs_baseline_ci95_high"]
    assert slowed["speed_within_noise"] is False and slowed["speed_vs_baseline_ci95_high"] < 1
    text = headline(list(rows.values()))
    assert "1.04x (0.85-1.27, within noise)" in text and "0.40x (0.35-0.47)" in text
    notes = speed_notes(list(rows.values()))
    assert "cpu, 1 thread(s) per rank, load 0.5 on 2 cores" in notes
    assert "**Warning:** the machine's load exceeded its cores while point 2 (3.5 on 2) ran" in notes


def test_the_headline_never_claims_a_speed_difference_within_noise():
    ddp, fsdp = _point(0, 1, 100.0, 0.2), _point(1, 1, 95.0, 0.2, strategy="fsdp")
    fsdp["memory"]["peak_allocated_mib_max"] = 6.0
    text = headline(build_rows([ddp, fsdp]))
    assert "at the same throughput within noise (0.95x, interval 0.63-1.43)" in text
    assert "its throughput" not in text.replace("same throughput", "")


@pytest.mark.slow
def test_two_identical_points_read_within_noise_and_a_slowed_point_does_not(tmp_path):
    """Real runs: a sweep of the same point twice (another trainer.seed), whose own report says
    "within noise" exactly when the interval it prints holds 1.0; then the same point slowed on purpose (the testing aid
    ``kind=slow``: each forward waits 50 ms) beside it, and the report over both sweeps."""
    common = [*TINY, "trainer.steps=30", "trainer.warmup_steps=3"]
    same = run_cli(["-m", "trainer.seed=1,2", *common, f"hydra.sweep.dir={tmp_path / 'same'}"], ROOT)
    assert same.returncode == 0, same.stderr[-2000:]
    result = json.loads(next((tmp_path / "same").glob("0_*/result.json")).read_text())
    assert len(result["throughput"]["step_times_s"]) == result["throughput"]["timed_steps"] >= 6
    assert result["throughput"]["load_avg_1m"] is not None and result["throughput"]["cpu_count"]
    own = (tmp_path / "same" / "report.md").read_text()
    # Two runs of one setting on a shared machine can differ past their intervals (CI's did: 1.39x,
    # 1.03-2.55), so what is held is the report's honesty: "within noise" exactly when the interval
    # it prints holds 1.0 (unit tests above hold the same with chosen figures).
    said = own.split("a repeat of ddp (point 1) runs at ")[1].split(" its speed")[0]
    low, high = (float(x) for x in said.split("(")[1].split(")")[0].split(",")[0].split("-"))
    if 1.0 not in (low, high):  # printed to 2 places: a bound printed 1.00 may be either side
        assert ("within noise" in said) == (low < 1.0 < high), said
    assert low <= float(said.split("x")[0]) <= high, said
    slowed = run_cli(["-m", "trainer.seed=3", *common, f"hydra.sweep.dir={tmp_path / 'slowed'}",
                      "hydra.sweep.subdir=slow_${hydra.job.num}"], ROOT,
                     env={"SHARDED_EXP_FAULT": "rank=0,step=0,kind=slow"})  # fmt: skip
    assert slowed.returncode == 0, slowed.stderr[-2000:]
    report = run_cli([str(tmp_path)], ROOT, module="sharded_exp.report")
    assert report.returncode == 0, report.stderr[-2000:]
    text = (tmp_path / "report.md").read_text()
    line = next(line for line in text.splitlines() if "a repeat of ddp" in line)
    slow = next(c for c in line.split(";") if "(slow_0)" in c)
    assert "within noise" not in slow, slow  # 50 ms a forward: a real difference, said as one
    assert float(slow.split(" runs at ")[1].split("x")[0]) < 0.5, slow


def test_points_with_fewer_timed_steps_than_the_setting_are_named():
    """trainer.min_timed_steps (measured: benchmarks/accuracy/timed_steps.py): a point timed on fewer
    steps is named in the report's speed notes; one timed on enough is not."""
    few, enough = _point(0, 1, 100.0, 0.1), _point(1, 2, 101.0, 0.1)
    for point, timed in ((few, 12), (enough, 30)):
        point["throughput"]["timed_steps"] = timed
        point["config"] = {"trainer": {"min_timed_steps": 30}}
    notes = speed_notes(build_rows([few, enough]))
    assert "**Few timed steps:** point 0 (12 of trainer.min_timed_steps=30)" in notes and "point 1 (30 of" not in notes
    assert "Few timed steps" not in speed_notes(build_rows([enough]))


def test_the_host_cost_per_op_of_an_fsdp2_step_is_measured_in_a_world_of_its_own():
    """A spawned process of its own (gloo, world size 1) shards the tiny model with FSDP2 and
    times its forward and backward, and its optimizer's step apart: the figures are the machine's, so only that it was measured is held; the
    caller keeps no process group."""
    import torch.distributed as dist

    from sharded_exp.measure import machine

    found = machine.measure_sharded_step_op_overhead("cpu", 1, ("fp32",))
    assert set(found) == {"fp32", "optimizer"} and found["fp32"] > 0 and found["optimizer"] > 0
    assert machine._sharded_figures("cpu", 1, ("fp32",)).keys() == {"sharded_step_op_overhead_s",
                                                                   "sharded_optimizer_op_overhead_s"}  # fmt: skip
    assert not dist.is_initialized()
