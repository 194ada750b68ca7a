"""W&B: the real offline run file is read back and must equal result.json."""

from __future__ import annotations

import time

import pytest

from tests.conftest import ROOT, TINY, read_result, run_cli
from tests.wandb_file import find_runs, read_run

WANDB_TINY = [o for o in TINY if o != "logger=none"] + ["logger=wandb"]


@pytest.fixture(scope="module")
def offline_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb_job") / "run_dir"
    proc = run_cli(["strategy=oss", *WANDB_TINY, f"hydra.run.dir={out}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = find_runs(out)
    assert len(runs) == 1, runs  # one W&B run per job, from rank 0 only
    return read_result(out), read_run(runs[0]), out


def test_run_identity_and_config(offline_job):
    result, run, out = offline_job
    assert run["group"] == out.name  # the run id (the sweep id under -m)
    assert run["job_type"] == "oss"
    assert "strategy=oss" in run["name"] and "trainer.steps=6" in run["name"]
    assert run["config"]["strategy"]["name"] == "oss"
    assert run["config"]["trainer"] == result["config"]["trainer"]
    assert run["exit_code"] == 0


def test_summary_equals_result_json(offline_job):
    result, run, _ = offline_job
    s = run["summary"]
    assert s["final_loss"] == result["final_loss"]
    assert s["params"] == result["params"]
    assert s["param_digest/sum"] == result["param_digest"]["sum"]
    assert s["param_digest/l2"] == result["param_digest"]["l2"]
    assert s["throughput/samples_per_s"] == result["throughput"]["samples_per_s"]
    mem = result["memory"]
    assert s["mem/peak_allocated_mib_max"] == {"max": mem["peak_allocated_mib_max"]}
    assert s["mem/predicted_model_states_mib_max"] == {"max": mem["predicted_model_states_mib_max"]}
    for entry in mem["per_rank"]:
        r = entry["rank"]
        assert s[f"mem/rank{r}/peak_allocated_mib"] == {"max": entry["peak_allocated_mib"]}
        assert s[f"mem/rank{r}/model_states_mib"] == {"max": sum(entry["model_states_mib"].values())}
    # metric summaries: min for loss; throughput is result.json's figure under the same name
    # as its per-step points (the median of them), and each timed step is one point
    losses = [h["train/loss"] for h in run["history"] if "train/loss" in h]
    assert s["train/loss"] == {"min": min(losses)}
    rates = [h["throughput/samples_per_s"] for h in run["history"] if "throughput/samples_per_s" in h]
    assert len(rates) == result["throughput"]["timed_steps"]
    assert s["throughput/step_time_s_median"] == result["throughput"]["step_time_s_median"]
    assert not any(k.startswith("train/samples") or k.startswith("train/step_time") for k in s)  # one name each


def test_history_equals_result_json(offline_job):
    result, run, _ = offline_job
    logged = {h["_step"]: h["train/loss"] for h in run["history"] if "train/loss" in h}
    assert logged == {h["step"]: h["loss"] for h in result["history"]}
    timed = [h for h in run["history"] if "throughput/step_time_s" in h]
    assert len(timed) == result["throughput"]["timed_steps"]


def test_logger_none_writes_no_wandb_files(tmp_path):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "wandb").exists()


def test_unreachable_server_does_not_fail_training(tmp_path):
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40}
    t0 = time.monotonic()
    proc = run_cli(
        [*WANDB_TINY, "logger.mode=online", "logger.init_timeout_s=5", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_result(tmp_path)["status"] == "ok"
    assert "W&B could not start" in proc.stderr
    assert elapsed < 120
