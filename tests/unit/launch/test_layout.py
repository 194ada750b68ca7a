"""sharded_exp.launch.layout: where ranks come from (torchrun and SLURM environments), the
shared run directory of an externally launched job, and SLURM node list expansion."""

from __future__ import annotations

import pytest

from sharded_exp.launch.layout import (
    Layout,
    expand_nodelist,
    external_layout,
    first_host,
    rendezvous_env,
    shared_run_dir,
    slurm_layout,
    will_spawn,
    with_shared_run_dir,
)

SLURM = {
    "SLURM_STEP_ID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_torchrun_variables_give_the_rank_layout():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert external_layout(env) == Layout(rank=3, world_size=8, local_rank=1, local_world_size=4, launcher="torchrun")


def test_torchrun_without_local_variables_is_one_machine_of_all_ranks():
    layout = external_layout({"RANK": "0", "WORLD_SIZE": "6"})
    assert (layout.local_rank, layout.local_world_size) == (0, 6)
    assert layout.master_addr is None and layout.master_port is None


def test_no_launcher_variables_means_this_job_spawns():
    assert external_layout({}) is None
    assert will_spawn({})
    assert not will_spawn({"RANK": "0", "WORLD_SIZE": "2"})
    assert external_layout({"RANK": "0"}) is None  # WORLD_SIZE is needed too


def test_a_multi_task_slurm_step_gives_ranks_from_its_tasks():
    layout = external_layout(SLURM)
    assert layout.launcher == "slurm"
    assert (layout.rank, layout.world_size, layout.local_rank) == (5, 8, 1)
    assert layout.local_world_size == 8 // 2  # tasks per node
    assert layout.master_addr == "gpu07"  # the step's first node
    assert layout.master_port == 20000 + 123456 % 20000


def test_a_slurm_step_of_one_task_or_no_step_spawns_its_own_ranks():
    assert slurm_layout({**SLURM, "SLURM_NTASKS": "1"}) is None
    assert slurm_layout({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}) is None
    assert will_spawn({**SLURM, "SLURM_NTASKS": "1"})


def test_slurm_nodes_fall_back_to_the_job_and_never_give_zero_local_ranks():
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST")}
    env.update(SLURM_NNODES="4", SLURM_JOB_NODELIST="cn[1-4]")
    layout = slurm_layout(env)
    assert layout.local_world_size == 2 and layout.master_addr == "cn1"
    layout = slurm_layout({**SLURM, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "4"})
    assert layout.local_world_size == 1  # 2 // 4 would be 0


def test_rendezvous_env_holds_only_what_the_launcher_left_unset():
    assert rendezvous_env(Layout(0, 2, 0, 2, "torchrun")) == {}
    slurm = slurm_layout(SLURM)
    assert rendezvous_env(slurm) == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 20000)}


def test_the_shared_run_dir_is_named_by_the_launchers_job_id():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}
    assert shared_run_dir(torchrun) == "${paths.output_dir}/runs/torchrun-abc"
    assert shared_run_dir({"RANK": "1", "WORLD_SIZE": "2"}) is None  # torchrun without an id
    assert shared_run_dir(SLURM) == "${paths.output_dir}/runs/slurm-123456.3"
    assert shared_run_dir({}) is None


def test_with_shared_run_dir_adds_the_directory_unless_chosen_or_a_sweep():
    env = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r1"}
    assert with_shared_run_dir(["strategy=fsdp"], env) == [
        "strategy=fsdp",
        "hydra.run.dir=${paths.output_dir}/runs/torchrun-r1",
    ]
    assert with_shared_run_dir(["hydra.run.dir=mine"], env) == ["hydra.run.dir=mine"]
    assert with_shared_run_dir(["-m", "strategy=ddp,fsdp"], env) == ["-m", "strategy=ddp,fsdp"]
    assert with_shared_run_dir(["strategy=fsdp"], {}) == ["strategy=fsdp"]


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("a1,b2", ["a1", "b2"]),
        ("gpu[03-05,09]", ["gpu03", "gpu04", "gpu05", "gpu09"]),
        ("gpu[03-05,09],cpu1", ["gpu03", "gpu04", "gpu05", "gpu09", "cpu1"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("node-[1-3]a", ["node-1a", "node-2a", "node-3a"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("", []),
    ],
)
def test_expand_nodelist_lists_every_host_in_order(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_first_host_of_a_node_list_or_localhost_when_empty():
    assert first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert first_host("") == "127.0.0.1"
