"""The planner's speed columns: each point's predicted step time on a device profile.

Per strategy and lever combination, one fake step at world size 1 (cut to a few units for a
deep model) is traced (:mod:`sharded_exp.predict.op_trace`); at each world size the trace is
priced on the machine (:mod:`sharded_exp.predict.step_time`): the compute is the same per
device at a fixed per-rank batch, the optimizer step shrinks with the rank's share of the
optimizer state (the strategy's memory model), and the strategy's time model schedules its
collectives on the links.

The machine: ``plan.device_profile`` (default: ``h100_sxm`` for ``plan.device=cuda``, ``this``
for ``cpu``, said in the plan's header), its GPUs ``plan.gpus_per_node`` to a node linked as
its profile says (NVLink), the nodes by ``plan.inter_node_gbps`` Gb/s per GPU. ``this`` is the
machine at hand, measured (:mod:`sharded_exp.measure.machine`): for ``plan.device=cpu`` its
CPU, every rank on it; for ``cuda`` its GPU (a plan without one is refused), linked as the
sourced profile of its name states, nodes as above.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

from sharded_exp.config import PlanConfig
from sharded_exp.measure.machine import this_cuda_host_link, this_cuda_profile, this_figures, this_profile
from sharded_exp.plan.depth import shapes_of
from sharded_exp.precision import Precision
from sharded_exp.predict.fake_step import fake_step
from sharded_exp.predict.prediction import predict
from sharded_exp.predict.step_time import (
    Machine,
    StepCompute,
    malloc_rule,
    math_dtype,
    predict_step_time,
    shards_parameters,
    sourced_link,
    step_compute,
    waits_before_step,
)
from sharded_exp.speed.profiles import load_device, load_link, network_link

DEFAULT_PROFILE = {"cuda": "h100_sxm", "cpu": "this"}
"""``plan.device_profile=null``: the profile planned for, by ``plan.device``."""
TRACE_UNITS = 4
"""Units a deep model is cut to for its trace (the middle ones stand for the rest)."""
SPEED_KEYS = ("step_time_s", "exposed_comm_s", "tokens_per_s_per_device", "mfu_pct")
"""The speed columns, in every format, by these names."""


def profile_name(cfg: PlanConfig) -> str:
    return str(cfg.plan.get("device_profile", None) or DEFAULT_PROFILE[str(cfg.plan.device)])


def threads_per_rank(world_size: int) -> int:
    """A CPU rank's torch threads, as a CPU run sets them (the cores shared out)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def machine(cfg: PlanConfig, world_size: int) -> Machine:
    """The machine a point at ``world_size`` runs on (see the module docstring)."""
    p = cfg.plan
    name = profile_name(cfg)
    inter = network_link(float(p.get("inter_node_gbps", 100.0)))
    if name == "this" and str(p.device) == "cuda":  # this machine's GPU, measured
        device = this_cuda_profile(bool(p.get("remeasure", False)))
        per_node = int(p.get("gpus_per_node", 8))
        # its GPUs' link as its sourced profile states it (none measured): a ValueError, said as
        # the row's speed note, where several GPUs share a node and no profile names this GPU
        intra = sourced_link(device.title, min(world_size, per_node))
        return Machine(device, intra or inter, inter, per_node, this_cuda_host_link(), device.host_memory)
    if name == "this":
        device, local = this_profile(threads_per_rank(world_size), bool(p.get("remeasure", False)))
        return Machine(device, local, None, max(world_size, 1), shared_cores=True)  # offload plans a GPU only
    device = load_device(name)
    intra = load_link(device.links["intra_node"]) if "intra_node" in device.links else None
    host = load_link(device.links["host"]) if "host" in device.links else None
    return Machine(device, intra or inter, inter, int(p.get("gpus_per_node", 8)), host, device.host_memory)


def measured_once(cfg: PlanConfig) -> PlanConfig:
    """``cfg`` with the ``this`` profile in the cache before any point is planned: this machine
    measured (again with ``plan.remeasure``, else only where the cache lacks it), once per plan,
    at the threads of each planned world size, and ``cfg`` returned with ``plan.remeasure=false``
    so that every point (and every worker process) reads those figures from the cache. Each
    point asked afresh would measure the machine once per point: tens of seconds each, for the
    same figures; and workers measuring at once would each count the others as a disturbance."""
    if profile_name(cfg) != "this":
        return cfg
    remeasure = bool(cfg.plan.get("remeasure", False))
    if str(cfg.plan.device) == "cuda":
        this_figures(1, remeasure, "cuda")
    else:
        for threads in sorted({threads_per_rank(ws) for ws in cfg.plan.world_sizes}):
            this_figures(threads, remeasure=remeasure)
    if not remeasure:
        return cfg
    out = cfg.copy()
    out.plan.remeasure = False
    return out


def describe(cfg: PlanConfig) -> str:
    """The header's line on the machine the speed columns are for."""
    name = profile_name(cfg)
    chosen = "" if cfg.plan.get("device_profile", None) else f" (the default for plan.device={cfg.plan.device})"
    if name == "this" and str(cfg.plan.device) == "cuda":
        return (f"speed: profile this, this machine's GPU measured, linked as its sourced profile states within "
                f"nodes of {cfg.plan.get('gpus_per_node', 8)} GPUs, {cfg.plan.get('inter_node_gbps', 100.0):g} Gb/s "
                "per GPU between nodes")  # fmt: skip
    if name == "this":
        return f"speed: profile this{chosen}: this machine measured, every rank on it, cores shared"
    device = load_device(name)
    return (f"speed: profile {name}{chosen}, {device.title}; {device.links.get('intra_node', 'no NVLink')} within nodes "
            f"of {cfg.plan.get('gpus_per_node', 8)} GPUs, {cfg.plan.get('inter_node_gbps', 100.0):g} Gb/s per GPU "
            "between nodes")  # fmt: skip


def _traced_cfg(cfg_s: PlanConfig, key: str | None):
    """``cfg_s`` as traced: one rank, one replica, a deep model (its number of blocks at
    ``key``) cut to :data:`TRACE_UNITS`."""
    c = cfg_s.copy()
    if "replicate" in c.strategy:
        c.strategy.replicate = 1
    if key and OmegaConf.select(c.model, key) > TRACE_UNITS and not c.trainer.get("freeze"):
        OmegaConf.update(c.model, key, TRACE_UNITS)
    return c


def traced(cfg_s: PlanConfig, device_type: str, layer_key: str | None) -> dict[str, Any]:
    """One traced fake step of ``cfg_s`` at world size 1: ``{"trace", "flops", "optimizer_mib"}``,
    or ``{"error"}`` naming why there is none. ``layer_key``: where the model keeps its depth.
    The step is trace-only (``memory=False``): the point's memory figures come from its own
    fake steps, so tracking this one's memory would be thrown away."""
    c = _traced_cfg(cfg_s, layer_key)
    try:
        est = fake_step(c, 1, 0, device_type, flops=True, trace=True, memory=False)
    except Exception as exc:  # noqa: BLE001 -- a point without a speed says why
        return {"error": f"no op trace: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"}
    states = predict(c.strategy, c.optimizer, str(Precision.of(c)), shapes_of(cfg_s), 1)  # one rank, one replica
    return {"trace": est.extra["trace"], "flops": est.flops_per_step,
            "optimizer_mib": states["model_states_mib"][0]["optimizer"]}  # fmt: skip


def speed_columns(cfg_s: PlanConfig, world_size: int, found: dict[str, Any], prediction) -> dict[str, Any]:
    """A point's speed columns (:data:`SPEED_KEYS` and the rest of
    :func:`~sharded_exp.predict.step_time.predict_step_time`), None where there is no trace."""
    empty = {k: None for k in SPEED_KEYS}
    if "error" in found:
        return empty | {"speed_note": found["error"]}
    try:
        at = machine(cfg_s, world_size)
        compute: StepCompute = step_compute(
            found["trace"],
            at.device,
            found["flops"],
            math_dtype(cfg_s),
            shards_parameters(cfg_s),
            malloc_rule(cfg_s),
            waits_before_step(cfg_s),
        )
        mine = max(p["optimizer"] for p in prediction["model_states_mib"])
        compute = compute.optimizer_scaled(mine / found["optimizer_mib"] if found["optimizer_mib"] else 1.0)
        out = predict_step_time(cfg_s, world_size, compute, shapes_of(cfg_s), at)
    except ValueError as exc:  # a profile without a figure the point needs (ProfileError), said
        return empty | {"speed_note": str(exc)}
    note = out.pop("error", None)
    return empty | out | ({"speed_note": note} if note else {})
