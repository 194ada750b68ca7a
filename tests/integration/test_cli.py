"""``python -m sharded_exp`` as a user runs it: subprocesses, real Hydra, real ranks."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from tests.helpers.jobs import ROOT, TINY, read_result, recording_imports, run_cli
from tests.helpers.overrides import SCALAR
from tests.helpers.runs import cli

RESULT_KEYS = {
    "status",
    "error",
    "strategy",
    "precision",
    "model",
    "optimizer",
    "world_size",
    "accelerator",
    "params",
    "steps",
    "final_loss",
    "param_digest",
    "throughput",
}


def test_default_job_prints_table_and_writes_result(tmp_path):
    from sharded_exp.compose import registry_schemas

    registry_schemas()  # the schema cache written, as on any machine where a command has run since the install
    env, imports = recording_imports(
        tmp_path,
        "torchmetrics",
        "torch.distributed.checkpoint",
        "torch.distributed.optim",
        "torch._dynamo",
        "torch",
        "torch.distributed.tensor",
    )
    run = tmp_path / "run"
    proc = run_cli([f"hydra.run.dir={run}"], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy  precision  world_size" in proc.stdout
    result = read_result(run)
    assert RESULT_KEYS <= result.keys()
    assert (result["status"], result["strategy"], result["precision"], result["world_size"]) == ("ok", "ddp", "32", 2)
    assert result["accelerator"] == "auto" and result["model"] == "mlp"
    assert set(result["param_digest"]) == {"sum", "l2"}
    assert result["throughput"]["samples_per_s"] > 0
    assert result["throughput"]["timed_steps"] == result["steps"] - 5
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    # the start-up, recorded (its 3 s target is a benchmark's, benchmarks/harness/startup.py): the
    # phases in their order, and the wait for the first step is the span from the job's start to it
    t = result["timeline"]
    phases = ["main", "imported", "launch", "validated", "rank_start", "process_group_ready", "built", "first_step",
              "last_step"]  # fmt: skip
    assert [t[k] for k in phases] == sorted(t[k] for k in phases)
    # the ranks start once the config is checked, and take their first step once the peak is
    # predicted (the parent's check goes on predicting while they start: launch/parent.py)
    assert t["validated"] <= t["rank_start"] and t["validated"] <= t["predicted"] <= t["first_step"]
    assert t["built"] <= t["logger_ready"]  # the tracker starts beside the first steps (ready before or after them)
    assert result["throughput"]["first_step_after_start_s"] == pytest.approx(t["first_step"] - t["main"])
    # the evaluation ran, and no process imported torchmetrics (seconds of imports in each): its
    # definitions are computed in plain torch (sharded_exp/train/evaluate.py); nor
    # torch.distributed.checkpoint (0.04 s of CPU in the parent and in the rank server), which only
    # saving, resuming and loading pretrained weights into shards use
    assert set(result["eval"]["final"]) == {"eval/accuracy", "eval/loss"}
    # torch.distributed.optim (0.2 s of CPU): by no process, where the command names no zero1 (the
    # rank server preloads it only then: sharded_exp/launch/forkserver.py). torch._dynamo (half a
    # second) by one process, the rank server: the parent's pre-flight check, whose fake step needs
    # it, runs in a process forked from the server, not in the parent. Nor torch's DTensor (with sympy,
    # half a second): the parent reads the check's spec without the modules of its schemas
    # (job/spec.py's Pickled), and it is ready to start the ranks by the time the check answers
    recorded = [line.split() for line in imports.read_text().splitlines()] if imports.exists() else []
    beyond = sorted((name, pid) for name, pid, _ in recorded if name != "torch")
    assert [name for name, _ in beyond] == ["torch._dynamo", "torch.distributed.tensor"], recorded
    assert beyond[0][1] == beyond[1][1], recorded  # one process: the rank server
    # torch itself (two seconds) by two processes: the rank server at once, and the parent only
    # once it had begun the check in the server (the timeline's "launch"): it composed the config
    # without torch, from the registries' schemas made again from their cache (schema_cache.py)
    torch_at = sorted(float(at) for name, _, at in recorded if name == "torch")
    assert len(torch_at) == 2 and torch_at[0] < t["launch"] <= torch_at[1], (torch_at, t["launch"])


def _spec(typed):
    from sharded_exp.checkpoint.plan import CheckpointPlan
    from sharded_exp.config import GradZeroing, ZeroGrad
    from sharded_exp.job.spec import JobSpec

    plan = CheckpointPlan(directory="/ckpt", format="dcp", every=0, keep=0, asynchronous=False, existing="refuse",
                          resume=None, start_step=0)  # fmt: skip
    return JobSpec(config={}, typed=typed, output_dir="/out", device_type="cpu", world_size=2, params=10, prediction={},
                   checkpoint=plan, zero_grad=GradZeroing(ZeroGrad.free, ZeroGrad.free))  # fmt: skip


def test_unpickling_a_spec_imports_no_module_its_schemas_live_in(tmp_path):
    # The parent of `python -m sharded_exp` unpickles the spec its check sends: the strategies'
    # modules (and torch's DTensor, sympy) would cost it half a second on the way to the first step.
    from sharded_exp.config import Config, TrainerConfig
    from sharded_exp.strategies.ddp import DDPConfig

    typed = Config(trainer=TrainerConfig(steps=3, warmup_steps=0), strategy=DDPConfig())
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(_spec(typed)))
    code = (
        "import pickle, sys; s = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "print(s.world_size, 'sharded_exp.strategies' in sys.modules, 'torch.distributed.tensor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spec.pkl")], capture_output=True, text=True)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr[-2000:]


@pytest.mark.slow
def test_a_machine_measured_for_the_first_time_predicts_the_step(tmp_path):
    # No this profile cached: the pre-flight check measures it, starting processes of its own
    # (the local link, FSDP2's host cost), from the process it runs in (forked from the rank server)
    run = tmp_path / "run"
    proc = run_cli([*TINY, "logger=none", f"hydra.run.dir={run}"], cwd=ROOT,
                   env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    throughput = read_result(run)["throughput"]
    assert throughput["predicted_step_time_s"] is not None, throughput.get("step_time_prediction")
    assert (tmp_path / "cache" / "sharded_exp" / "this_profile.json").exists()


@pytest.mark.slow
def test_sharded_ddp_at_precision_16(tmp_path):
    proc = run_cli(["strategy=sharded_ddp", "precision=16", *TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(tmp_path)
    assert (result["status"], result["strategy"], result["precision"]) == ("ok", "sharded_ddp", "16")


def test_enum_values_and_an_interpolation_between_them_reach_the_ranks(tmp_path):
    """The parent composes from the registries' schemas made again from their cache and sends the
    check plain data (sharded_exp/schema_cache.py): enum values (FSDP's dtypes) and one field
    interpolating another of the same enum run as composed."""
    overrides = ["strategy=fsdp", "precision=bf16", "strategy.param_dtype=bfloat16",
                 "strategy.reduce_dtype=${strategy.param_dtype}", "logger=none"]  # fmt: skip
    proc = run_cli([*overrides, *TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(tmp_path)
    assert result["status"] == "ok"
    config = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "param_dtype: bfloat16" in config and "reduce_dtype: ${strategy.param_dtype}" in config


@pytest.mark.slow
def test_failing_rank_fails_the_job_and_names_the_rank(tmp_path):
    env = {"SHARDED_EXP_FAULT": "rank=1,step=2,kind=raise"}
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env)
    assert proc.returncode == 1
    result = read_result(tmp_path)
    assert result["status"] == "failed"
    assert result["error"] == "rank 1: RuntimeError: injected fault on rank 1 at step 2"
    assert "injected fault" in result["traceback"]
    assert "rank 1" in proc.stderr
    # every failing rank keeps its traceback; the peer's is the lost connection, later
    first = json.loads((tmp_path / "rank1_error.json").read_text())
    assert "Traceback" in first["traceback"]


@pytest.mark.slow  # a rank's exit in the default tier: test_failures.py's ranks that exit 0 without a result;
# the words for a non-zero exit code: tests/unit/launch/test_diagnose.py
def test_exiting_rank_fails_the_job(tmp_path):
    env = {"SHARDED_EXP_FAULT": "rank=0,step=1,kind=exit"}
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env)
    assert proc.returncode == 1
    assert read_result(tmp_path)["error"] == "rank 0: process exited with code 3"


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not installed",
)
def test_torchrun_provides_the_ranks(tmp_path):
    """Under torchrun the ranks come from its environment and nothing is spawned."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "sharded_exp",
            "strategy=oss",
            "trainer.world_size=1",
            *TINY,
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(tmp_path)
    assert result["status"] == "ok"
    assert result["world_size"] == 2  # from torchrun, not from trainer.world_size=1
    assert len(result["memory"]["per_rank"]) == 2


@pytest.mark.slow  # the default tier's CLI job: test_default_job_prints_table_and_writes_result; resume: test_checkpoint
# ----------------------------------------------- what a job prints and result.json says
def test_a_resumed_bar_ends_full_and_the_output_directory_is_printed(tmp_path):
    args = [*TINY, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.progress_bar=true"]
    first = cli([*args, "trainer.steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    log_file = tmp_path / "sharded_exp.log"
    first_log = log_file.read_text()
    proc = cli([*args, "trainer.resume=auto", "hydra.verbose=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Not a terminal: a plain line per log interval (no carriage returns), from step 2 to 4: full, not 50%
    lines = [line for line in proc.stderr.splitlines() if ": step " in line]
    assert "\r" not in proc.stderr and lines[-1].startswith("[rank 0] ddp x2: step 4/4 (100%), final loss "), lines
    # the last step's line once, its loss the one result.json and the end-of-run table keep
    assert [line for line in lines if "step 4/4" in line] == [lines[-1]]
    assert lines[-1].endswith(f"final loss {read_result(tmp_path)['final_loss']:.4f}"), lines
    # resumed at step 2 of 4, the CPU tracker takes two: one step is timed, said before it runs, by rank 0
    assert "[rank 0] 1 timed step(s) (steps 3 to 3): fewer than trainer.min_timed_steps=30" in proc.stderr
    # The end-of-run table and the output directory on stdout; messages on stderr and in the run's log
    assert f"output: {tmp_path}" in proc.stdout and "strategy  precision" in proc.stdout
    assert "[rank 0]" not in proc.stdout
    check_log_lines(first_log)
    assert "[DEBUG]" not in first_log and "][parent][sharded_exp.launch.parent][INFO] finished: ok" in first_log
    second = log_file.read_text()[len(first_log) :]  # appended by the resumed run
    check_log_lines(second)
    for rank in (0, 1):  # hydra.verbose=true reaches the spawned ranks
        assert f"][rank {rank}][sharded_exp.launch.rank][DEBUG] gloo process group of 2 ready" in second
    assert "][rank 0][sharded_exp.train.components][INFO] ddp x2: step 4/4 (100%)" in second


def check_log_lines(text: str) -> None:
    """Every line of a run's log: time, who (the parent or a rank), logger, level, message."""
    import re

    lines = text.splitlines()
    pattern = r"\[\d{4}-\d\d-\d\d [\d:,]+\]\[(parent|rank \d+)\]\[[\w.]+\]\[(DEBUG|INFO|WARNING|ERROR)\] \S"
    assert lines and all(re.match(pattern, line) for line in lines), lines


def test_the_log_formats_are_the_job_loggings():
    """The ranks' handlers (sharded_exp.logs) format as Hydra's job logging (conf/hydra/job_logging)."""
    import yaml

    from sharded_exp import logs

    conf = yaml.safe_load((ROOT / "sharded_exp" / "conf" / "hydra" / "job_logging" / "sharded_exp.yaml").read_text())
    assert conf["formatters"]["file"]["format"] == logs.FILE_FORMAT
    assert conf["formatters"]["console"]["format"] == logs.CONSOLE_FORMAT
    handlers = conf["handlers"]
    assert handlers["file"]["filename"].endswith("/" + logs.LOG_NAME) and handlers["console"]["stream"].endswith(
        "stderr"
    )


def test_result_json_names_the_device_that_ran_the_job(shared_runs):
    _, result = shared_runs("strategy=ddp", *SCALAR)
    device = result["device"]
    assert device["type"] == "cpu" and device["count"] == os.cpu_count() and device["threads_per_rank"] >= 1


def test_the_docs_place_per_rank_under_memory():
    page = (ROOT / "docs" / "concepts" / "how-a-job-runs.md").read_text()
    assert "`memory.per_rank`" in page
    assert "result.json`: `per_rank`" not in page and "top-level `per_rank`" not in page
