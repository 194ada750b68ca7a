"""The prediction of a job's memory, made once for the parent before any rank steps.

The same functions fill every run's ``predicted_*`` figures and the planner's table
(:mod:`sharded_exp.plan`), so every run checks the planner. The model is built on the
meta device: shapes only, no memory, a 7B model in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sharded_exp import precision
from sharded_exp.config import JobGroups, OptimizerConfig, ZeroGrad
from sharded_exp.errors import ConfigError
from sharded_exp.measure.cuda_kernels import cublas_workspace_mib
from sharded_exp.models import build_model, units
from sharded_exp.optim import optimizer_spec
from sharded_exp.predict.alloc_trace import alloc_conf_of, point_figures, replayable
from sharded_exp.predict.allocator import parse_alloc_conf
from sharded_exp.predict.fake_step import FakeStepError, fake_step
from sharded_exp.predict.host_memory import offload_host_mib
from sharded_exp.predict.memory_model import predict_model_states_mib
from sharded_exp.predict.step_time import run_step_time
from sharded_exp.strategies import STRATEGIES, memory_of, offloads_to_host, traits_of
from sharded_exp.strategies.base import StrategyConfig

MIB = 2**20


@dataclass
class ModelShapes:
    """What the memory model needs to know of a model, read from a meta-device build."""

    groups: list[list[tuple]]
    """Parameter shapes per optimizer parameter group, in order."""
    blocks: list[int]
    """Elements of each of the model's units (``models.units``: FSDP's)."""
    root: int
    """Elements outside the blocks."""
    state_shapes: dict[str, tuple]
    """Every state-dict entry's shape by name (checkpoints are checked against it)."""
    frozen: list[tuple] = ()
    """Shapes of the frozen parameters (``trainer.freeze``): held, never given a gradient
    or optimizer state."""
    element_bytes: float = 4.0
    """Bytes per parameter element (4: float32; 8: a float64 model), averaged over the
    parameters when their dtypes differ. Gradients and optimizer state take the same."""
    trainable_blocks: list[int] | None = None
    """Elements of each unit that take a gradient (:attr:`blocks` less ``trainer.freeze``'s):
    what gradient collectives carry. None: not known (every element)."""
    trainable_root: int | None = None
    """Elements outside the blocks that take a gradient (None: not known)."""
    trainable_block_tensors: list[int] | None = None
    """Parameter tensors of each unit that take a gradient: the calls a strategy that reduces
    each gradient on its own makes per unit (None: not known)."""
    trainable_root_tensors: int | None = None
    """Parameter tensors outside the blocks that take a gradient (None: not known)."""

    @property
    def params(self) -> int:
        return sum(self.blocks) + self.root


def meta_model(model_cfg, freeze=()) -> torch.nn.Module:
    """The configured model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return build_model(model_cfg, freeze)


def model_shapes(
    model_cfg, optimizer_cfg: OptimizerConfig, module: torch.nn.Module | None = None, freeze=()
) -> ModelShapes:
    """Shapes of the configured model (or of ``module``, its meta-device build, frozen as
    configured) and its optimizer groups. A parameter shared by two modules (a tied LM
    head) counts once."""
    module = meta_model(model_cfg, freeze) if module is None else module
    groups = [[tuple(p.shape) for p in g["params"]] for g in optimizer_spec(optimizer_cfg, module).param_groups]
    blocks = [sum(p.numel() for p in block.parameters()) for block in units(module)]
    trainable = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in units(module)]
    tensors = [sum(1 for p in block.parameters() if p.requires_grad) for block in units(module)]
    return ModelShapes(
        groups=groups,
        blocks=blocks,
        root=sum(p.numel() for p in module.parameters()) - sum(blocks),
        state_shapes={k: tuple(v.shape) for k, v in module.state_dict().items()},
        frozen=[tuple(p.shape) for p in module.parameters() if not p.requires_grad],
        element_bytes=_element_bytes(module),
        trainable_blocks=trainable,
        trainable_root=sum(p.numel() for p in module.parameters() if p.requires_grad) - sum(trainable),
        trainable_block_tensors=tensors,
        trainable_root_tensors=sum(1 for p in module.parameters() if p.requires_grad) - sum(tensors),
    )


def _element_bytes(module: torch.nn.Module) -> float:
    numel = sum(p.numel() for p in module.parameters())
    return sum(p.numel() * p.element_size() for p in module.parameters()) / numel if numel else 4.0


def predict(
    strategy_cfg: StrategyConfig,
    optimizer_cfg: OptimizerConfig,
    precision_name: str,
    shapes: ModelShapes,
    world_size: int,
    ranks=None,
) -> dict[str, Any]:
    """Predicted model states of every rank (or of ``ranks``) and the parameters gathered
    on top at the peak.

    ``{"model_states_mib": [{"params", "grads", "optimizer"} per rank], "transient_params_mib": x}``
    """
    memory = memory_of(strategy_cfg.name)
    states = predict_model_states_mib(
        memory, strategy_cfg, optimizer_cfg, shapes.groups, world_size, shapes.frozen, shapes.element_bytes, ranks
    )
    gathered = (
        memory.transient_param_numel(strategy_cfg, shapes.blocks, shapes.root, world_size) if shapes.blocks else 0
    )
    compute = shapes.element_bytes if precision_name == "32" else precision.compute_bytes(precision_name)
    return {"model_states_mib": states, "transient_params_mib": gathered * compute / MIB}


def _compile_note(cfg: JobGroups) -> str:
    if not cfg.trainer.get("compile", False):
        return ""
    return "trainer.compile: the units are faked eager (inductor's fusions can only lower the peak)"


def peaks_of_ranks(phases, states: list[dict[str, float]], rank: int) -> list[float]:
    """Every rank's peak from the faked ``rank``'s: ``phases`` holds its (peak, breakdown)
    in each phase of the step, ``states`` every rank's model states. Another rank's peak is
    lower by its smaller states (OSS's uneven shards), in the proportion the faked peak
    holds them: inside an optimizer step the step's own temporaries are as large as the
    states (Adam's sqrt of exp_avg_sq), so there a smaller shard is worth twice its states;
    mid-backward only the grads made so far count. A rank with a much smaller shard may
    peak in the other phase (forward/backward rather than its optimizer step): each phase's
    peak is lowered so, and the larger one is its peak."""
    mine = states[rank]
    # the optimizer step's temporaries go with the optimizer state a rank steps
    scaled = {"params": "params", "grads": "grads", "optimizer": "optimizer", "optimizer_step": "optimizer"}
    return [
        max(
            peak - sum(p.get(k, 0.0) * (1 - other[s] / mine[s]) for k, s in scaled.items() if mine[s])
            for peak, p in phases
        )
        for other in states
    ]


def _zero_grad_note(cfg: JobGroups) -> str:
    """What the fake step counts of trainer.zero_grad (it clears gradients by the rule the
    strategy applies, as the run does)."""
    rule = traits_of(cfg.strategy.name).zero_grad_rule(ZeroGrad(cfg.trainer.zero_grad))
    if rule.reason:
        return f"trainer.zero_grad={rule.requested.value} not honoured, faked as {rule.applied.value}: {rule.reason}"
    return ""


def _fake_rank(cfg: JobGroups, world_size: int, device_type: str, prediction, shapes: ModelShapes, rank: int, flops):
    # a run (which counts FLOPs) also records the op trace its step time is predicted from
    """The fake step of ``rank`` (:func:`fake_step`), or the reason there is none (a str)."""
    precision_name = precision.Precision.of(cfg)

    def states_of(name: str) -> dict[str, float]:  # for a strategy that cannot run fake
        other = predict(STRATEGIES.config_class(name)(), cfg.optimizer, precision_name, shapes, world_size)
        return {**other["model_states_mib"][rank], "gathered": other["transient_params_mib"]}

    try:
        return fake_step(cfg, world_size, rank, device_type, states_of, flops=flops, trace=flops)
    except ConfigError:  # the model is refused (a parameter made in forward), not just unpredictable
        raise
    except Exception as exc:  # noqa: BLE001 -- recorded: the run goes on without a peak prediction
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        if not isinstance(exc, FakeStepError):  # not inside the step: the prediction's own code
            reason = f"the fake step failed: {type(exc).__name__}: {reason}"
        return reason


def _resident(parts: dict[str, float], mine: dict[str, float]) -> dict[str, float]:
    """A tracked breakdown filed against the rank's own model states ``mine``."""
    parts = dict(parts)
    # Parameters tracked beyond the resident ones are gathered (unsharded) copies: FSDP's units.
    if parts["params"] > mine["params"]:
        parts["gathered"] += parts["params"] - mine["params"]
        parts["params"] = mine["params"]
    # What the optimizer step allocates beyond the rank's state is its temporaries
    # (foreach Adam's sqrt(v)): the tracker files both as optimizer memory.
    parts["optimizer_step"] = max(0.0, parts["optimizer"] - mine["optimizer"])
    parts["optimizer"] -= parts["optimizer_step"]
    return parts


HOST_STATES = ("params", "grads", "optimizer", "optimizer_step")
"""What FSDP's CPU offload keeps in (and steps on) host memory."""


PINNED_HOST_RULE = (
    "host memory: each parameter and gradient shard pinned on its own, rounded up to a power of two "
    "by torch's CachingHostAllocator; the optimizer state, and the host step's temporaries for its largest "
    "tensor (its largest group under optimizer.foreach=true), at their bytes"
)
"""The rule :func:`offload_host` follows, as a prediction's ``rules`` name it."""


def _offloaded(cfg, shapes, world_size, mine, parts, per_rank, phases_mib, rules) -> tuple:
    """FSDP's CPU offload: the resident (sharded) parameters, gradients and optimizer state
    live in host memory; the device holds what is gathered and computed. Returns (device peak
    per rank, breakdown, phases, the host's side: :func:`offload_host`), ``rules`` told why."""
    states = HOST_STATES
    rules["cpu_offload"] = ("the sharded parameters, gradients and optimizer state in host memory, and the "
                            "optimizer step on the host, by rule")  # fmt: skip
    rules["pinned_host"] = PINNED_HOST_RULE

    def on_host(p: dict[str, float]) -> dict[str, float]:
        # the rank's own shard of each state; beyond it (a unit's unsharded gradient before its
        # reduce-scatter) is on the device, and stays in its part
        return {k: min(mine.get(k, p[k]), p[k]) for k in states}

    moved = on_host(parts)
    per_rank = [x - sum(moved.values()) for x in per_rank]
    for phase, (peak, p) in list(phases_mib.items()):
        host = on_host(p)
        phases_mib[phase] = (peak - sum(host.values()), {**p, **{k: p[k] - host[k] for k in states}})
    parts = {**parts, **{k: parts[k] - moved[k] for k in states}}
    return per_rank, parts, phases_mib, offload_host(cfg, shapes, world_size)


def offload_host(cfg: JobGroups, shapes: ModelShapes, world_size: int) -> tuple[list[float], dict[str, float]]:
    """CPU offload's host memory: every rank's (MiB), and the fullest rank's parts, as torch's
    pinned-memory allocator and the host's optimizer step hold it
    (:mod:`sharded_exp.predict.host_memory`), under the config's allocator settings
    (:func:`~sharded_exp.predict.alloc_trace.alloc_conf_of`)."""
    from sharded_exp.predict.step_time import host_step_bytes  # lazy: steps a real optimizer once

    memory = memory_of(cfg.strategy.name)
    settings = parse_alloc_conf(alloc_conf_of(cfg))
    new_bytes = host_step_bytes(cfg).new_tensors
    foreach = bool(cfg.optimizer.get("foreach"))  # an offloaded run's default: per tensor (strategies/fsdp.py)
    ranks = []
    trainable = [s for group in shapes.groups for s in group]
    for rank in range(world_size):
        pinned = memory.pinned_numels(cfg.strategy, trainable, shapes.frozen, rank, world_size)
        held = [memory.resident_numel(cfg.strategy, list(g), [], rank, world_size)["optimizer"] for g in shapes.groups]
        stepped = max((sum(g) if foreach else max(g, default=0) for g in held), default=0)
        optimizer = [n for g in held for n in g]
        figures = offload_host_mib(pinned, optimizer, cfg.optimizer, shapes.element_bytes, settings, stepped, new_bytes)
        ranks.append(figures)
    largest = max(ranks, key=lambda r: r["total"])
    return [r["total"] for r in ranks], {k: v for k, v in largest.items() if k != "total"}


def predict_peak(
    cfg: JobGroups,
    world_size: int,
    device_type: str,
    prediction: dict[str, Any],
    shapes: ModelShapes,
    flops: bool = True,
    keep_trace: bool = False,
    local_world_size: int | None = None,
) -> dict[str, Any]:
    """The peak of every rank from one fake step (:mod:`sharded_exp.predict.fake_step`).

    The rank with the most model states is faked; another rank's peak is lower in
    proportion to its smaller model states (e.g. OSS's uneven shards). Returns ``{"per_rank_mib": [...] or None,
    "rank", "breakdown_mib", "flops_per_step" (one rank), "method", "note", "seconds",
    "error"}``; ``error`` says why there is no prediction (the model cannot run fake). ``keep_trace``: on
    CUDA, ``"alloc_trace"`` (events, allocator setting, workspace MiB: plan/deepen.py) in place of
    the figures replayed from it (``"allocator"`` None): a plan replays few of its fakes as they are.
    ``local_world_size``: the ranks on this node (:func:`~sharded_exp.predict.step_time.run_step_time`)."""
    states = [sum(p.values()) for p in prediction["model_states_mib"]]
    rank = states.index(max(states))
    est = _fake_rank(cfg, world_size, device_type, prediction, shapes, rank, flops)
    if isinstance(est, str):
        return {"per_rank_mib": None, "error": est}
    mine = prediction["model_states_mib"][rank]
    parts = _resident(est.breakdown_mib, mine)
    # Another rank's peak: the faked one's, lowered by its smaller states (peaks_of_ranks).
    phases = (est.extra or {}).get("phases") or {"all": (est.peak_mib, est.breakdown_mib)}
    per_rank = peaks_of_ranks(
        [(peak, _resident(p, mine)) for peak, p in phases.values()], prediction["model_states_mib"], rank
    )
    # The rules a prediction follows beyond the fake tensors, each named in ``rules``: gloo's
    # reduce-scatter copy (held by fake tensors), and on CUDA cuBLAS's workspace (added).
    workspace, rules = 0.0, {}
    if (est.extra or {}).get("gloo_reduce_scatters"):
        rules["gloo_reduce_scatter"] = ("gloo reduces a copy of each reduce-scatter's input: the input's bytes more "
                                        "while it runs (in the temporaries)")  # fmt: skip
    if device_type == "cuda":
        workspace, rules["workspace"] = cublas_workspace_mib()
    parts["workspace"] = workspace
    per_rank = [x + workspace for x in per_rank]
    phases_mib = {str(k): (peak + workspace, {**_resident(p, mine), "workspace": workspace}) for k, (peak, p) in phases.items()}  # fmt: skip
    host = (None, None)  # CPU offload: every rank's host memory, the fullest one's parts
    if offloads_to_host(cfg.strategy):
        per_rank, parts, phases_mib, host = _offloaded(cfg, shapes, world_size, mine, parts, per_rank, phases_mib, rules)  # fmt: skip
    build = (est.extra or {}).get("build") or {}
    events = (est.extra or {}).get("alloc_events")  # CUDA: what the caching allocator is asked
    replayed = events is not None and not keep_trace  # else the caller replays it where it needs the figures
    allocator = point_figures(events, alloc_conf_of(cfg), workspace) if replayed else None
    kept = {"alloc_trace": (events, alloc_conf_of(cfg), workspace)} if keep_trace and events is not None else {}
    kept = kept if kept and replayable(alloc_conf_of(cfg)) else {}  # cudaMallocAsync: no caching allocator to replay
    return {
        "per_rank_mib": per_rank,
        # the faked rank's peak while the model is built (a sharded build: its shards plus one
        # whole unit), apart from the training's; null where the build could not be tracked
        "build_peak_mib": build.get("peak_mib"),
        "build_breakdown_mib": build.get("breakdown_mib"),
        "rank": rank,
        "breakdown_mib": parts,
        # the faked rank's peak in each phase (forward/backward "step", "optimizer"), broken down
        "phases_mib": phases_mib,
        "flops_per_step": est.flops_per_step,
        "method": est.method,
        "note": "; ".join(n for n in (est.note, _compile_note(cfg), _zero_grad_note(cfg)) if n),
        "seconds": est.seconds,
        "kernels": f"{device_type}: fake tensors on the CPU device"
        + (", with CUDA's kernel choices (fused attention, foreach optimizer)" if device_type == "cuda" else ""),
        "rules": rules,
        "host_mib": host[0],  # per rank, where the strategy keeps states in host memory (CPU offload)
        "host_breakdown_mib": host[1],  # the fullest rank's: pinned blocks, their tensors' bytes, optimizer, step
        # CUDA: the allocator's rounding and cache on top of the peak, fragmentation, the context
        # (sharded_exp.predict.alloc_trace.point_figures); None on CPU (no caching allocator)
        "allocator": allocator,
        **kept,
        # a run's step time, predicted from this step's op trace (predict/step_time.py)
        "speed": run_step_time(cfg, world_size, device_type, est, shapes, prediction, local_world_size)
        if flops
        else None,
        "error": None,
    }
