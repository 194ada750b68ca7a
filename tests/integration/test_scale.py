"""At the scale sharding is for: no rank holds the whole model unasked, sharded (dcp)
checkpoints move between strategies and world sizes, and a torchrun job is one job.

Real torchrun launchers (``python -m torch.distributed.run``), real gloo ranks, real files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid

import pytest
import torch

from benchmarks.common import free_port
from sharded_exp import checkpoint
from tests.helpers.jobs import ROOT, TINY, launch_job, read_result, run_cli
from tests.helpers.processes import finish
from tests.helpers.states import max_relative_diff
from tests.helpers.wandb_file import find_runs, read_run

GPT = ["model=gpt", "model.d_model=64", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=64"]
# Parameters outweigh activations (6.4 M parameters, batch 2 x 8 tokens), as in the models
# sharding is for. FSDP's steady peak (58 MiB a rank, warm-up 2 steps so the tracked window
# holds a step with the optimizer state in place) is well below the rank's model states plus
# the full model (48.5 + 24.2 MiB).
WIDE = ["model=gpt", "model.d_model=256", "model.n_heads=4", "model.n_layers=8", "model.seq_len=8", "model.vocab_size=64",
        "trainer.batch_size=2", "trainer.warmup_steps=2"]  # fmt: skip


def full_optimizer_state(path, scratch) -> dict:
    """The full optimizer state of a checkpoint in either format (dcp via the export command)."""
    if checkpoint.read_meta(str(path))["checkpoint_format"] == "dcp":
        proc = run_cli(["export", str(path), str(scratch)], cwd=ROOT, module="sharded_exp.checkpoint")
        assert proc.returncode == 0, proc.stderr[-2000:]
        path = scratch
    return torch.load(os.path.join(path, "optim.pt"), weights_only=True)


# ------------------------------------------------------------------------ the digest
def test_digest_from_local_shards_equals_the_full_states(tmp_path):
    """param_digest is summed from each rank's own shards (3 ranks: uneven FSDP shards) and
    equals the float64 sum and L2 norm of the full model written by save_final_state."""
    result = launch_job(["strategy=fsdp", "trainer.world_size=3", "trainer.save_final_state=true", *GPT], tmp_path)
    assert result["status"] == "ok", result["error"]
    full = torch.load(tmp_path / "model_final.pt", weights_only=True)
    total = sum(t.double().sum().item() for t in full.values())
    l2 = math.sqrt(sum(t.double().pow(2).sum().item() for t in full.values()))
    assert result["param_digest"]["sum"] == pytest.approx(total, rel=1e-12)
    assert result["param_digest"]["l2"] == pytest.approx(l2, rel=1e-12)
    # each rank's own digest covers only its shard: their squares add up to the whole
    local = [r["local_param_digest"]["l2"] ** 2 for r in result["memory"]["per_rank"]]
    assert all(0 < part < l2**2 for part in local)
    assert sum(local) == pytest.approx(l2**2, rel=1e-9)


# --------------------------------------------------------------------- memory budget
@pytest.mark.slow
def test_fsdp_trains_checkpoints_and_resumes_in_a_budget_a_full_gather_would_break(tmp_path):
    """A per-rank budget between FSDP's peak and what holding the full model would need:
    the run, its dcp checkpoint and a resume all fit; gathering the full model (asked for
    with save_final_state) is refused as out of memory by the same budget."""
    free = launch_job(["strategy=fsdp", *WIDE, "trainer.steps=4"], tmp_path / "free")
    assert free["status"] == "ok", free["error"]
    mem = free["memory"]
    full_model_mib = free["params"] * 4 / 2**20
    resident = mem["model_states_mib_max"]
    assert mem["peak_allocated_mib_max"] < resident + full_model_mib  # room for a budget between
    budget = (mem["peak_allocated_mib_max"] + resident + full_model_mib) / 2
    limited = [
        "strategy=fsdp",
        *WIDE,
        f"trainer.memory_limit_mib={budget}",
        "trainer.checkpoint_every=2",
        "trainer.checkpoint_format=dcp",
    ]
    run = launch_job([*limited, "trainer.steps=4"], tmp_path / "run")
    assert run["status"] == "ok", run["error"]
    assert checkpoint.read_meta(run["checkpoint"])["checkpoint_format"] == "dcp"
    resumed = launch_job([*limited, "trainer.steps=6", f"trainer.resume={run['checkpoint']}"], tmp_path / "resumed")
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["start_step"] == 4
    gathered = launch_job([*limited, "trainer.steps=4", "trainer.save_final_state=true"], tmp_path / "gathered")
    assert gathered["status"] == "oom", gathered  # the guard is not vacuous: the full model does not fit
    b = gathered["memory"]["oom_breakdown"]  # what was live then (issue 25), said to be after training
    assert b["step"] is None and b["phase"].startswith("after training") and b["tracked_mib"] > budget
    assert sum(b["by_category_mib"].values()) == pytest.approx(b["tracked_mib"])


# ---------------------------------------------------------------- dcp checkpoints
@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """A dcp checkpoint written by fsdp at 2 ranks after 3 of 6 steps, and the uninterrupted run."""
    out = tmp_path_factory.mktemp("fsdp_dcp")
    first = launch_job(["strategy=fsdp", *GPT, "trainer.steps=3", "trainer.checkpoint_every=3"], out / "first")
    assert first["status"] == "ok", first["error"]
    straight = launch_job(["strategy=fsdp", *GPT, "trainer.steps=6", "trainer.save_final_state=true"], out / "straight")
    assert straight["status"] == "ok", straight["error"]
    return first["checkpoint"], out


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world_size", [("sharded_ddp", 3), ("ddp", 1)])
def test_dcp_checkpoint_of_fsdp_resumes_in_another_strategy_and_world_size(
    strategy, world_size, fsdp_checkpoint, tmp_path
):
    path, _ = fsdp_checkpoint
    saved = full_optimizer_state(path, tmp_path / "saved")
    resumed = launch_job(
        [
            f"strategy={strategy}",
            *GPT,
            f"trainer.world_size={world_size}",
            "trainer.steps=4",
            "trainer.checkpoint_every=4",
            "trainer.checkpoint_format=consolidated",
            f"trainer.resume={path}",
        ],
        tmp_path / "run",
    )
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["start_step"] == 3
    after = full_optimizer_state(resumed["checkpoint"], None)
    assert set(after["state"]) == set(saved["state"])
    for name, state in after["state"].items():
        # Adam's step count went on from the checkpoint's 3 (a fresh optimizer would be at 1)
        assert float(saved["state"][name]["step"]) == 3.0 and float(state["step"]) == 4.0, name
        # and the moments are the saved ones, updated once: exp_avg = b1 * saved + (1 - b1) * grad
        # cannot hold for |grad| <= 10 * |saved| unless saved was loaded
        assert state["exp_avg"].shape == saved["state"][name]["exp_avg"].shape
    moved = [
        (after["state"][n]["exp_avg_sq"] - 0.999 * saved["state"][n]["exp_avg_sq"]).min().item() for n in saved["state"]
    ]
    assert min(moved) >= -1e-9  # v' = b2 * v + (1 - b2) g^2 >= b2 * v: only true if v was carried over


@pytest.mark.slow  # the default tier's: test_checkpoint.py resumes dcp (fsdp-gpt-dcp) and resumes in another
# strategy (test_checkpoint_from_sharded_ddp_resumes_under_ddp); this test's fixture costs two fsdp runs
def test_dcp_resume_in_another_strategy_matches_the_uninterrupted_run(fsdp_checkpoint, tmp_path):
    path, out = fsdp_checkpoint
    resumed = launch_job(
        ["strategy=sharded_ddp", *GPT, "trainer.steps=6", "trainer.save_final_state=true", f"trainer.resume={path}"],
        tmp_path,
    )
    assert resumed["status"] == "ok", resumed["error"]
    straight = torch.load(out / "straight" / "model_final.pt", weights_only=True)
    assert max_relative_diff(torch.load(tmp_path / "model_final.pt", weights_only=True), straight) <= 1e-5


@pytest.mark.slow
def test_async_dcp_save_changes_nothing_and_resumes(tmp_path):
    args = ["strategy=fsdp", *GPT, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.save_final_state=true"]
    sync = launch_job(args, tmp_path / "sync")
    asynchronous = launch_job([*args, "trainer.checkpoint_async=true"], tmp_path / "async")
    assert sync["status"] == asynchronous["status"] == "ok", asynchronous["error"]
    ckpts = [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "async" / "checkpoints"))]
    assert ckpts == [2, 4, 6]
    a = torch.load(tmp_path / "sync" / "model_final.pt", weights_only=True)
    b = torch.load(tmp_path / "async" / "model_final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = launch_job([*args, "trainer.steps=8", "trainer.resume=auto"], tmp_path / "async")
    assert resumed["status"] == "ok" and resumed["start_step"] == 6, resumed["error"]


def test_checkpoint_async_needs_dcp(tmp_path):
    from sharded_exp.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.checkpoint_async=true needs trainer.checkpoint_format=dcp"):
        launch_job(["trainer.checkpoint_async=true", "trainer.checkpoint_format=consolidated"], tmp_path)


# ------------------------------------------------------------------------- torchrun
def torchrun(args: list[str], cwd, *launcher: str, env: dict | None = None):
    """torchrun started in the background; wait for it with :func:`finish` (which has the timeout)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "sharded_exp", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_dirs(cwd) -> list:
    return sorted((cwd / "outputs" / "runs").iterdir())


@pytest.mark.slow  # a launcher, not a strategy: its job (oss, the MLP, fp32) runs in the default tier without it;
# torchrun's variables to a rank layout, a world size and one writer: unit/launch (test_layout, test_preflight,
# test_parent)
def test_torchrun_standalone_makes_one_run_directory_with_the_real_world_size(tmp_path):
    proc = torchrun(["strategy=oss", *TINY, "trainer.world_size=5"], tmp_path, "--standalone", "--nproc-per-node=2")
    code, output = finish(proc)
    assert code == 0, output[-3000:]
    (run,) = run_dirs(tmp_path)  # exactly one, named for torchrun's run id
    assert run.name.startswith("torchrun-")
    result = read_result(run)
    assert (result["status"], result["world_size"], result["launcher"]) == ("ok", 2, "torchrun")
    assert result["config"]["trainer"]["world_size"] == 2
    assert "world_size: 2" in (run / ".hydra" / "config.yaml").read_text()
    assert len(result["memory"]["per_rank"]) == 2


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_checkpoint(tmp_path):
    args = ["strategy=fsdp", *TINY, "trainer.steps=8", "trainer.checkpoint_every=4", "trainer.resume=auto"]
    proc = torchrun(
        args,
        tmp_path,
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        env={"SHARDED_EXP_FAULT": "rank=1,step=6,kind=raise"},  # the first attempt only
    )
    code, output = finish(proc)
    assert code == 0, output[-3000:]
    assert "injected fault on rank 1 at step 6" in output  # the first attempt did fail
    (run,) = run_dirs(tmp_path)
    result = read_result(run)
    assert (result["status"], result["start_step"], result["steps_done"]) == ("ok", 4, 8)
    assert result["resumed_from"].endswith("step_00000004")
    failed = json.loads((run / "attempts" / "1" / "result.json").read_text())
    assert failed["status"] == "failed" and "rank 1" in failed["error"]


@pytest.mark.slow
def test_a_torchrun_rank_stuck_tearing_down_exits_stop_grace_s_later_with_its_stacks(tmp_path):
    """Under torchrun no parent of ours kills a rank stuck tearing gloo down: it ends itself
    trainer.stop_grace_s later, its stacks on stderr, and rank 0's result is written."""
    proc = torchrun(
        ["strategy=ddp", *TINY, "trainer.stop_grace_s=2"],
        tmp_path,
        "--standalone",
        "--nproc-per-node=2",
        env={"SHARDED_EXP_FAULT": "rank=1,step=0,kind=hang_at_exit"},
    )
    code, output = finish(proc, timeout=240)
    assert "SHARDED_EXP_FAULT: hang_at_exit on rank 1" in output
    assert code != 0 and "Timeout (0:00:02)!" in output, output[-3000:]
    assert "in run_rank" in output  # the stuck rank's stack says where it was
    (run,) = run_dirs(tmp_path)
    assert read_result(run)["status"] == "ok"


@pytest.mark.slow
def test_two_torchrun_launchers_as_two_nodes_are_one_job(tmp_path):
    """--nnodes=2 on the loopback address (c10d rendezvous): a stand-in for two nodes."""
    port, run_id = free_port(), f"two-nodes-{uuid.uuid4().hex[:8]}"
    launcher = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
    ]
    wandb = [o for o in TINY if o != "logger=none"] + ["logger=wandb"]
    args = ["strategy=zero1", *wandb, "trainer.world_size=1", "trainer.checkpoint_every=6"]
    procs = [torchrun(args, tmp_path, *launcher) for _ in range(2)]
    outs = [finish(p) for p in procs]
    assert [c for c, _ in outs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    (run,) = run_dirs(tmp_path)
    assert run.name == f"torchrun-{run_id}"
    result = read_result(run)
    assert (result["status"], result["world_size"]) == ("ok", 2)
    assert "world_size: 2" in (run / ".hydra" / "config.yaml").read_text()
    (wandb_run,) = find_runs(run)  # one W&B run, from rank 0
    assert read_run(wandb_run)["config"]["trainer"]["world_size"] == 2
    # a checkpoint written there resumes there
    procs = [torchrun([*args, "trainer.steps=8", "trainer.resume=auto"], tmp_path, *launcher) for _ in range(2)]
    outs = [finish(p) for p in procs]
    assert [c for c, _ in outs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    resumed = read_result(run)
    assert (resumed["status"], resumed["start_step"], resumed["steps_done"]) == ("ok", 6, 8)


# ------------------------------------ torchrun's NCCL error mode is replaced, the user's is not
def test_our_nccl_error_mode_replaces_torchruns_default_but_not_the_users():
    import os

    from sharded_exp.launch.rank import nccl_diagnosis_env, nccl_settings, process_environ

    ours = nccl_diagnosis_env("/run")
    rank_env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # what torchrun's agent exports to every rank
    # torchrun started without it: the 1 is the agent's default, ours (2) replaces it
    assert nccl_settings(ours, rank_env, {"PATH": "/bin"}, torchrun=True)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    # the user exported it before torchrun: theirs stays
    mine = nccl_settings(ours, rank_env, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, torchrun=True)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in mine and mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    # not under torchrun, or torchrun's environment unreadable: a set value is the user's
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_settings(ours, rank_env, None, torchrun=True)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_settings(ours, rank_env, {}, torchrun=False)
    assert "PATH" in process_environ(os.getpid()) and process_environ(2**22 + 7) is None  # no such process
