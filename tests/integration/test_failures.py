"""Rank failures and signals, as a user meets them: ``python -m sharded_exp`` in a
subprocess where the command's own part is held (its exit code, what it prints, signals,
process trees), a job launched in this process where result.json is all that is held (a
second interpreter's start-up is seconds); faults injected with SHARDED_EXP_FAULT."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time

import pytest
import torch

from sharded_exp import checkpoint
from sharded_exp.compose import compose
from tests.helpers.jobs import ROOT, TINY, launch_job, read_result, run_cli, tiny
from tests.helpers.processes import LONG, descendants, finish, start_job, survivors, wait_until
from tests.helpers.runs import cli


def fault_time(stderr: str) -> float:
    return float(re.search(r"SHARDED_EXP_FAULT: \w+ on rank \d+ at step \d+, time ([\d.]+)", stderr).group(1))


def run_with_fault(tmp_path, fault: str, *extra: str):
    proc = run_cli(
        [*LONG, *extra, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env={"SHARDED_EXP_FAULT": fault}, timeout=240
    )
    exit_time = time.time()
    return proc, read_result(tmp_path), exit_time - fault_time(proc.stderr)


def test_a_raising_rank_ends_the_job_within_30_s_naming_it(tmp_path):
    proc, result, seconds = run_with_fault(tmp_path, "rank=1,step=3,kind=raise")
    assert proc.returncode == 1
    assert seconds < 30, f"fault to exit took {seconds:.1f} s"
    assert result["error"] == "rank 1: RuntimeError: injected fault on rank 1 at step 3"
    assert "rank 1: RuntimeError" in proc.stderr
    # Each rank's traceback is kept: the raiser's, and its peer's lost connection.
    first = json.loads((tmp_path / "rank1_error.json").read_text())
    assert "injected fault" in first["traceback"] and "Traceback" in first["traceback"]
    peer = json.loads((tmp_path / "rank0_error.json").read_text())
    assert peer["time"] >= first["time"] and "Traceback" in peer["traceback"]


def test_a_hanging_rank_is_named_when_the_collective_times_out(tmp_path):
    proc, result, seconds = run_with_fault(tmp_path, "rank=1,step=3,kind=hang", "trainer.timeout_s=5")
    assert proc.returncode == 1
    assert 5 <= seconds < 5 + 20, f"fault to exit took {seconds:.1f} s"
    assert result["status"] == "failed"
    assert re.search(r"collective timed out after 5 s .* in step 3: rank 1 did not arrive", result["error"])
    assert result["error"].startswith("rank 0: ")


def test_a_rank_stuck_after_it_finished_is_killed_and_the_results_kept(tmp_path):
    """Tearing down gloo can hang (its destructor waits for a thread that waits for the
    GIL): a job whose ranks all sent their results ends stop_grace_s later, not never."""
    proc = run_cli(
        [*TINY, "trainer.stop_grace_s=2", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env={"SHARDED_EXP_FAULT": "rank=1,step=0,kind=hang_at_exit"},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHARDED_EXP_FAULT: hang_at_exit on rank 1" in proc.stderr
    assert "rank(s) 1 finished training but had not exited trainer.stop_grace_s=2 s later" in proc.stderr
    result = read_result(tmp_path)
    assert result["status"] == "ok" and len(result["memory"]["per_rank"]) == 2


def test_an_out_of_memory_rank_fails_the_point_as_oom_not_a_hang(tmp_path):
    """In this process (the command's exit code 1 is held by the raising rank's test); the
    whole job, not only fault to exit, within 30 s."""
    start = time.monotonic()
    launch_job(["trainer.steps=100000"], tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=3,kind=oom"})
    assert time.monotonic() - start < 30
    result = read_result(tmp_path)
    assert result["status"] == "oom"
    assert result["error"] == "rank 1: torch.OutOfMemoryError: injected out-of-memory on rank 1 at step 3"
    # No budget was crossed: no breakdown, and why (issue 25); on CPU no snapshot either, said why.
    mem = result["memory"]
    assert mem["oom_breakdown"] is None and "not over trainer.memory_limit_mib" in mem["oom_breakdown_error"]
    assert mem["memory_snapshot"]["files"] == [] and "on CPU" in mem["memory_snapshot"]["reason"]


# ------------------------------------------------------------------------------ signals
SENT = {"sigterm": signal.SIGTERM, "ctrl_c": signal.SIGINT, "sighup": signal.SIGHUP, "sigterm_group": signal.SIGTERM}


@pytest.mark.parametrize(
    "how",
    [pytest.param("sigterm", marks=pytest.mark.slow), "ctrl_c", pytest.param("sighup", marks=pytest.mark.slow),
     pytest.param("sigterm_group", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_signal_stops_the_ranks_saves_and_leaves_no_process(tmp_path, how):
    run = tmp_path / "run"
    log = tmp_path / "job.log"
    proc = start_job([*LONG, "trainer.checkpoint_every=5", f"hydra.run.dir={run}"], log)
    wait_until((run / "checkpoints" / "step_00000005").exists, proc, log)
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # two ranks and the forkserver
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)  # as SLURM or kill does: the job's process only
    else:
        # Ctrl-C, the terminal closing (SIGHUP, issue 22.9), or SIGTERM as systemd, scancel and
        # kill -TERM -PGID send it: the whole group, the rank server among it
        os.killpg(proc.pid, SENT[how])
    _, output = finish(proc, log, timeout=60)
    assert proc.returncode == 128 + SENT[how], output[-3000:]
    assert not (run / ".lock").exists()
    assert not survivors(tree), "processes outlived the job"
    result = read_result(run)
    assert result["status"] == "stopped"
    assert 5 <= result["steps_done"] < 100000
    # The state at the stop was saved, and it is complete.
    assert result["checkpoint"] == str(run / "checkpoints" / f"step_{result['steps_done']:08d}")
    assert (run / "checkpoints" / f"step_{result['steps_done']:08d}" / "meta.json").exists()
    if how != "sigterm":
        return

    # Resuming from the stop ends bit-identical to a run that was never stopped.
    n = result["steps_done"] + 2
    short = [o for o in LONG if not o.startswith("trainer.steps")] + [
        f"trainer.steps={n}",
        "trainer.save_final_state=true",
    ]
    resumed = run_cli([*short, "trainer.resume=auto", f"hydra.run.dir={run}"], cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = run_cli([*short, f"hydra.run.dir={tmp_path / 'straight'}"], cwd=ROOT)
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = torch.load(run / "model_final.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "model_final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_rank_that_ignores_the_stop_is_killed_after_the_grace_period(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "job.log"
    fault = {"SHARDED_EXP_FAULT": "rank=1,step=3,kind=hang"}
    proc = start_job([*LONG, "trainer.stop_grace_s=3", f"hydra.run.dir={run}"], log, env=fault)
    wait_until(lambda: "SHARDED_EXP_FAULT: hang" in log.read_text(), proc, log)
    time.sleep(1)  # rank 1 hangs in step 3; rank 0 waits in a collective (timeout 60 s)
    tree = descendants(proc.pid)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, output = finish(proc, log, timeout=60)
    seconds = time.time() - t0
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert seconds < 3 + 10
    assert not survivors(tree), "processes outlived the job"
    result = read_result(run)
    assert result["status"] == "stopped"
    assert "ranks were killed (still running trainer.stop_grace_s=3 s after the signal)" in result["error"]


# ------------------------------------------ out-of-memory errors that torch does not type
@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        pytest.param("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5 ... "
                     "Cuda failure 'out of memory'", marks=pytest.mark.slow),
        pytest.param("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                     marks=pytest.mark.slow),
    ],
    ids=["cuda-call", "nccl", "cublas"],
)  # fmt: skip
def test_every_allocation_failure_is_oom(message, tmp_path):
    from omegaconf import open_dict

    from sharded_exp.launch.parent import launch
    from tests.helpers.jobs import tiny

    cfg = compose(tiny(["model=custom", "model._target_=tests.helpers.user_models.build_raises", "trainer.steps=2"]))
    with open_dict(cfg.model):
        cfg.model.message = message  # any text, as a CUDA library would raise it
    result = launch(cfg, str(tmp_path))
    assert result.status == "oom", result.error


def test_the_nccl_process_group_is_bound_to_the_ranks_gpu(monkeypatch):
    """On CUDA the default group gets ``device_id`` (NCCL's communicator made for that GPU
    now); gloo gets none. The device script checks it on a GPU."""
    import datetime

    import torch.distributed as dist

    from sharded_exp.launch.rank import init_group

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    timeout = datetime.timedelta(seconds=5)
    init_group("nccl", "store", 1, 2, timeout, torch.device("cuda", 1))
    init_group("gloo", "store", 0, 2, timeout, torch.device("cpu"))
    assert calls[0] == ("nccl", {"store": "store", "rank": 1, "world_size": 2, "timeout": timeout,
                                 "device_id": torch.device("cuda", 1)})  # fmt: skip
    assert "device_id" not in calls[1][1]


def test_an_aborted_communicator_is_reported_in_the_step_that_hung(monkeypatch):
    """NCCL's watchdog aborts the communicator (error mode 2) and the step's synchronize()
    returns: the backend's error is read after the step, so the report names this step."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch._C._distributed_c10d import ErrorType

    from sharded_exp.train import liveness

    class Backend:
        error = ErrorType.TIMEOUT

        def get_error(self):
            return self.error

    backend = Backend()
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=SimpleNamespace(_get_backend=lambda device: backend)))
    monkeypatch.setattr(liveness, "current_step", 7)
    with pytest.raises(RuntimeError, match="NCCL reported TIMEOUT in step 7") as caught:
        liveness.raise_if_aborted(torch.device("cuda", 0))
    assert liveness.is_timeout(caught.value)  # so the rank's report names the missing rank, as for gloo
    liveness.raise_if_aborted(torch.device("cpu"))  # gloo raises inside the step itself
    backend.error = ErrorType.SUCCESS
    liveness.raise_if_aborted(torch.device("cuda", 0))
    assert liveness.collective_error(object()) is None  # a backend without get_error (gloo)


# ------------ diverged runs, signals, dead parents and ranks that exit without a result
def test_a_diverged_run_is_not_ok(tmp_path):
    """In this process: the command prints any status but ok as ``error: <result's error>``
    and exits 1 (sharded_exp/__main__.py), which the raising rank's test holds."""
    launch_job(["trainer.steps=4"], tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=1,kind=inf_grad"})
    result = read_result(tmp_path)
    assert result["status"] == "diverged" and result["first_nonfinite_step"] == 3
    assert "diverged: final loss nan, loss first non-finite at step 3" in result["error"]


@pytest.mark.slow  # the diverged run itself: the test above
def test_a_diverged_point_of_a_sweep_gets_no_saving_in_the_report(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *TINY,
        "trainer.steps=4",
        "trainer.grad_clip=0",
        "optimizer.lr=0.001,1e30",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_cli(args, cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "failed or diverged" in proc.stderr, proc.stderr[-3000:]
    rows = {r["status"]: r for r in csv.DictReader(open(sweep / "report.csv"))}
    assert set(rows) == {"ok", "diverged"}
    bad = rows["diverged"]
    assert bad["first_nonfinite_step"] and bad["speed_vs_baseline"] == bad["peak_saving_pct"] == ""
    assert bad["parity_vs_baseline"] == ""


def test_a_rank_killed_by_a_signal_is_named_not_its_peer(tmp_path):
    """In this process (the command's exit code 1 for a failed job is held by the faults above:
    a second interpreter would add its start-up and nothing asserted)."""
    launch_job(["trainer.steps=100000"], tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=3,kind=kill"})
    result = read_result(tmp_path)
    assert result["status"] == "failed"
    error = result["error"]
    assert error.startswith("rank 1: killed by signal 9 (SIGKILL)"), error
    assert "OOM killer" in error


@pytest.mark.slow
@pytest.mark.parametrize(
    "check, says",
    [("false", "can't allocate memory"), ("true", "of host memory")],
    ids=["the-allocator-fails", "refused-before-it-starts"],
)
def test_a_cpu_allocation_failure_is_oom_and_does_not_fail_the_sweep(check, says, tmp_path):
    """A point too large for the machine is a result (oom), whether the allocator says so
    or, with the host memory check on (trainer.host_memory_check), the pre-flight does before any rank starts."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", *TINY, "trainer.steps=3", "trainer.batch_size=8,1000000000000",
                    f"trainer.host_memory_check={check}", f"hydra.sweep.dir={sweep}"], cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    status = {p["config"]["trainer"]["batch_size"]: p for p in points}
    assert status[8]["status"] == "ok"
    assert status[10**12]["status"] == "oom" and says in status[10**12]["error"]


SLOW_CHECK = """
import multiprocessing, os, time

if multiprocessing.parent_process() is not None:  # the pre-flight check's process, not the job's parent
    with open({marker!r}, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
"""


def held_by_a_plugin(tmp_path, source: str):
    """A job started with a plugin module of ``source`` (its ``{marker}`` a file that it writes
    its pid to, then holds the process that imported it); returns the job's process, its log
    and the pid the plugin wrote, once it has."""
    marker, log = tmp_path / "held", tmp_path / "job.log"
    (tmp_path / "holding_plugin.py").write_text(source.format(marker=str(marker)))
    env = {"SHARDED_EXP_PLUGINS": "holding_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = start_job([*TINY, "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], log, env=env)
    wait_until(lambda: marker.exists() and marker.read_text(), proc, log)
    return proc, log, int(marker.read_text())


@pytest.mark.slow
def test_the_pre_flight_check_exits_when_the_parent_is_killed(tmp_path):
    """The check runs in a process forked from the rank server (sharded_exp/launch/preflight.py):
    a parent killed meanwhile (SIGKILL: it cannot pass anything on) leaves it working for nobody,
    holding a GPU where there is one. A plugin module, imported by the check, holds it there."""
    proc, _, check = held_by_a_plugin(tmp_path, SLOW_CHECK)
    assert check != proc.pid and check in descendants(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    assert not survivors({check}), "the check outlived the job's parent"


SLOW_PEAK = """
import multiprocessing, os, time

if multiprocessing.parent_process() is not None:  # the check's process (and the ranks': unused there)
    from sharded_exp.launch import preflight

    def slow_peak(*args, **kwargs):
        with open({marker!r}, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)

    preflight.predict_peak = slow_peak
"""


@pytest.mark.slow
def test_a_sigterm_while_the_ranks_wait_for_the_peak_stops_the_job_at_once(tmp_path):
    """The ranks start while the check predicts the peak (sharded_exp/launch/parent.py) and wait
    for it before their first step. A SIGTERM to the parent alone (``kill PID``, a container's
    stop) ends that wait: the check and the ranks are killed, and the job ends stopped, with
    SIGTERM's exit code, not when the prediction would have come. A plugin holds the prediction."""
    proc, log, check = held_by_a_plugin(tmp_path, SLOW_PEAK)
    wait_until(lambda: len(descendants(proc.pid) - {check}) >= 3, proc, log)  # the server and two ranks
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    end = time.time() + 10
    while survivors(tree) and time.time() < end:
        time.sleep(0.2)
    assert not survivors(tree), survivors(tree)
    result = read_result(tmp_path / "run")
    assert result["status"] == "stopped" and "before their first step" in result["error"], result.get("error")


@pytest.mark.slow
def test_ranks_exit_when_the_parent_is_killed(tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    proc = start_job([*LONG, "trainer.checkpoint_every=5", f"hydra.run.dir={run}"], log)
    wait_until((run / "checkpoints" / "step_00000005").exists, proc, log)
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # two ranks and the forkserver
    proc.kill()  # SIGKILL: the parent cannot pass anything on
    proc.wait(timeout=30)
    end = time.time() + 10
    while survivors(tree) and time.time() < end:
        time.sleep(0.2)
    assert not survivors(tree), survivors(tree)
    found = checkpoint.complete_checkpoints(str(run / "checkpoints"))
    time.sleep(1)
    assert checkpoint.complete_checkpoints(str(run / "checkpoints")) == found  # nobody trains on


@pytest.mark.slow
def test_sigterm_at_a_non_zero_rank_stops_the_job_with_its_signal(tmp_path):
    proc = cli(
        [*LONG, "trainer.checkpoint_every=1000"], tmp_path, env={"SHARDED_EXP_FAULT": "rank=1,step=3,kind=sigterm"}
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "stopped by signal 15 after step" in proc.stderr and "None" not in proc.stderr
    result = read_result(tmp_path)
    assert result["status"] == "stopped" and result["signal"] == signal.SIGTERM
    assert result["checkpoint"] == str(tmp_path / "checkpoints" / f"step_{result['steps_done']:08d}")


@pytest.mark.slow
def test_a_second_signal_kills_and_says_so_and_names_the_checkpoint(tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.log"
    proc = start_job([*LONG, "trainer.checkpoint_every=5", "trainer.stop_grace_s=30", f"hydra.run.dir={run}"], log,
                     env={"SHARDED_EXP_FAULT": "rank=1,step=8,kind=hang"})  # fmt: skip
    wait_until(lambda: "SHARDED_EXP_FAULT: hang" in log.read_text(), proc, log)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, output = finish(proc, log, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    result = read_result(run)
    assert "ranks were killed (at a second signal, SIGTERM)" in result["error"]
    assert "after step None" not in output and "stopped by signal 15: " in output
    assert result["checkpoint"] == str(run / "checkpoints" / "step_00000005")


@pytest.mark.slow
def test_a_long_history_does_not_deadlock_the_parent(tmp_path):
    """Found on this pass: rank 0's payload (the history, with every rank's memory per
    interval) larger than a pipe's buffer blocked rank 0 in put() while the parent waited
    for it to exit; the parent now reads the payload while it waits."""
    result = launch_job(["trainer.steps=1200", "trainer.log_interval=1"], tmp_path)
    assert result["status"] == "ok" and len(result["history"]) == 1200
    assert len(json.dumps(result["history"])) > 2**16  # more than a pipe holds


@pytest.mark.parametrize(
    "how, ranks, blamed",
    [("os", "[0,1]", None), ("sys", "[0,1]", None), ("os", "[1]", 1)],  # None: either rank (both did it)
    ids=["every-rank-os-exit-0", "every-rank-sys-exit-0", "one-rank-os-exit-0"],
)
def test_a_rank_that_exits_0_without_a_result_is_the_named_failure(how, ranks, blamed, tmp_path):
    t0 = time.monotonic()
    overrides = ["model=custom", "model._target_=tests.helpers.user_models.build_exits", f"+model.how={how}",
                 f"+model.ranks={ranks}", "trainer.timeout_s=60"]  # fmt: skip
    result = launch_job(overrides, tmp_path)
    assert time.monotonic() - t0 < 40, "the parent waited for a result that never came"
    assert result["status"] == "failed"
    assert result["error"].startswith(f"rank {blamed}:" if blamed is not None else "rank "), result["error"]
    assert "exit" in result["error"] and "Connection" not in result["error"], result["error"]
    assert read_result(tmp_path)["status"] == "failed"
    assert not (tmp_path / ".lock").exists()


@pytest.mark.slow
def test_an_out_of_memory_in_the_final_evaluation_keeps_the_training_figures(tmp_path):
    """The training ran to its end: its steps, loss, history, speed and memory stay in result.json,
    the status is oom and the error names the final evaluation."""
    run = tmp_path / "run"
    proc = run_cli([*tiny(["model=custom"]), "model._target_=tests.helpers.user_models.build_oom_in_evaluation",
                    "trainer.steps=4", "trainer.warmup_steps=2", "trainer.min_timed_steps=0", "logger=none",
                    f"hydra.run.dir={run}"], cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "oom" and "out of memory in the final evaluation" in result["error"]
    assert result["steps_done"] == 4 and result["final_loss"] is not None and result["history"]
    assert result["throughput"]["timed_steps"] == 2 and result["memory"]["peak_allocated_mib_max"] > 0
    assert not (run / "training.partial.json").exists()
