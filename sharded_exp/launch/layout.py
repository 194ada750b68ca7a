"""Where the ranks come from: this job spawns them, or an external launcher (torchrun, a
SLURM job step) started each one as a process of its own.

Standard library only: :mod:`sharded_exp.launch.forkserver` asks :func:`will_spawn`
before anything heavy is imported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """This process's place among the ranks, as an external launcher set it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """torchrun or slurm."""
    master_addr: str | None = None
    """Rendezvous host for ``env://`` when the launcher does not export one (SLURM)."""
    master_port: int | None = None


def external_layout(env=os.environ) -> Layout | None:
    """The rank layout set by torchrun or a multi-task SLURM step; None if this job spawns.

    A pure query: nothing is exported (see :func:`rendezvous_env`).
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return Layout(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            launcher="torchrun",
        )
    return slurm_layout(env)


def will_spawn(env=os.environ) -> bool:
    """Does this job start its own ranks? False under torchrun or inside a multi-task SLURM step."""
    return external_layout(env) is None


def slurm_layout(env) -> Layout | None:
    """Rank layout of a SLURM job step (srun, or hydra/launcher=submitit_slurm): tasks are ranks.

    Only inside a job step with several tasks; a lone ``python -m sharded_exp`` in an
    allocation still spawns its own ranks. The rendezvous is the step's first node, on a
    port derived from the job id.
    """
    if "SLURM_STEP_ID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return None
    world_size = int(env["SLURM_NTASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    return Layout(
        rank=int(env["SLURM_PROCID"]),
        world_size=world_size,
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=max(1, world_size // nodes),
        launcher="slurm",
        master_addr=first_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))),
        master_port=20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000,
    )


def rendezvous_env(layout: Layout) -> dict[str, str]:
    """The ``MASTER_ADDR``/``MASTER_PORT`` that ``env://`` needs and the launcher did not set."""
    out = {}
    if layout.master_addr is not None:
        out["MASTER_ADDR"] = layout.master_addr
    if layout.master_port is not None:
        out["MASTER_PORT"] = str(layout.master_port)
    return out


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        return "127.0.0.1"
    prefix, ranges = head.group(1), head.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix
