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


def shared_run_dir(env=os.environ) -> str | None:
    """The run directory every rank of an externally launched job agrees on, or None.

    Hydra would give each rank its own ``<paths.output_dir>/runs/<time>`` (the times differ by
    microseconds), and a torchrun restart yet another. The launcher's job id names one
    directory instead: ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``, a fresh id per
    ``--standalone`` invocation, the same across its restarts) or the SLURM job and step.
    An interpolation of ``paths.output_dir``, which Hydra resolves.
    """
    layout = external_layout(env)
    if layout is None:
        return None
    if layout.launcher == "torchrun" and env.get("TORCHELASTIC_RUN_ID"):
        return f"${{paths.output_dir}}/runs/torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if layout.launcher == "slurm":
        return f"${{paths.output_dir}}/runs/slurm-{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    return None


def with_shared_run_dir(args: list[str], env=os.environ) -> list[str]:
    """Command-line overrides plus ``hydra.run.dir=<shared_run_dir>`` for an externally
    launched single run that did not choose its directory itself."""
    chosen = any(a.startswith(("hydra.run.dir=", "hydra/run")) for a in args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    run_dir = shared_run_dir(env)
    return args if chosen or multirun or run_dir is None else [*args, f"hydra.run.dir={run_dir}"]


def rendezvous_env(layout: Layout) -> dict[str, str]:
    """The ``MASTER_ADDR``/``MASTER_PORT`` that ``env://`` needs and the launcher did not set."""
    out = {}
    if layout.master_addr is not None:
        out["MASTER_ADDR"] = layout.master_addr
    if layout.master_port is not None:
        out["MASTER_PORT"] = str(layout.master_port)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order, as ``scontrol show hostnames`` prints them.

    Handles the forms SLURM writes: comma lists (``a1,b2``), a prefix with a bracketed
    list of numbers and ranges (``gpu[03-05,09]``, zero padding kept), several bracket
    groups (``rack[1-2]-node[01-02]``: every combination, the last varying fastest) and
    suffixes (``node-[1-3]a``).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        combos = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not group:
                continue
            options = [literal + value for value in _expand_group(group)] if group else [literal]
            combos = [c + o for c in combos for o in options]
        hosts.extend(combos)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if current:
        items.append(current)
    return [i for i in items if i]


def _expand_group(group: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (the width of a range's first number is kept)."""
    out = []
    for part in group.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
        else:
            out.append(part)
    return out


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    hosts = expand_nodelist(nodelist)
    return hosts[0] if hosts else "127.0.0.1"
