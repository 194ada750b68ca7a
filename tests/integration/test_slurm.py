"""Clusters: the SLURM launcher composes, and SLURM tasks become ranks without spawning."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from sharded_exp.launch.layout import Layout, expand_nodelist, first_host, rendezvous_env, slurm_layout
from tests.helpers.jobs import ROOT, TINY, read_result, run_cli
from tests.helpers.processes import finish


def test_submitit_slurm_launcher_composes(tmp_path):
    proc = run_cli(
        [
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.nodes=2",
            "hydra.launcher.tasks_per_node=4",
            "--cfg",
            "hydra",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SlurmLauncher" in proc.stdout and "tasks_per_node: 4" in proc.stdout and "nodes: 2" in proc.stdout


def test_rank_layout_from_slurm_environment(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = {
        "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
    }  # fmt: skip
    layout = slurm_layout(env)
    assert isinstance(layout, Layout) and layout.launcher == "slurm"
    assert (layout.rank, layout.world_size, layout.local_rank, layout.local_world_size) == (5, 8, 1, 4)
    assert rendezvous_env(layout) == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert "MASTER_ADDR" not in os.environ  # a query: reading the layout exports nothing
    # a lone process in an allocation (no job step, or one task) spawns its own ranks
    assert slurm_layout({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) is None
    assert slurm_layout({**env, "SLURM_NTASKS": "1"}) is None
    assert first_host("cpu[1,3-4],gpu2") == "cpu1"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("localhost", ["localhost"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu[03-05,09],cpu1", ["gpu03", "gpu04", "gpu05", "gpu09", "cpu1"]),
        ("cpu[1,3-4],gpu2", ["cpu1", "cpu3", "cpu4", "gpu2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: widths grow
        ("n[008-010]", ["n008", "n009", "n010"]),  # padding kept
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("node-[1-3]a", ["node-1a", "node-2a", "node-3a"]),
        ("x[1-2]y[3],z", ["x1y3", "x2y3", "z"]),
    ],
)
def test_every_form_of_slurm_node_list(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.slow
def test_two_slurm_tasks_train_as_two_ranks(tmp_path):
    """Two processes given the environment srun gives its tasks: one job, two ranks."""
    job_id = str(random.randint(1, 10**6))
    procs = []
    for task in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(
            SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(task), SLURM_LOCALID=str(task),
            SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID=job_id,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sharded_exp",
                    "strategy=oss",
                    "trainer.world_size=1",
                    *TINY,
                    f"hydra.run.dir={tmp_path}",
                ],  # fmt: skip
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    try:
        outs = [finish(p, timeout=240) for p in procs]  # past it: killed, and the timeout raised
    finally:
        for p in procs:  # the other task too, when one timed out
            if p.poll() is None:
                p.kill()
    assert [code for code, _ in outs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    result = read_result(tmp_path)
    assert result["status"] == "ok" and result["world_size"] == 2
    assert len(result["memory"]["per_rank"]) == 2
