"""Per-rank model-state memory, predicted: the ZeRO paper's accounting, made exact.

Model states are parameters, gradients and optimizer state (Rajbhandari et al. 2020).
Which of them a rank holds in full and which only for its shard is each strategy's to
say (``resident_numel`` on its memory model, ``Strategy.memory``); this module turns element counts into
bytes. Two details make the prediction match the real tensors rather than the paper:

- The shard is the real partition: fairscale OSS assigns each parameter, group by group,
  to the rank with the least so far (greedy by size, close to but not exactly 1/N);
  :func:`greedy_partition` reproduces it.
- torch AMP keeps parameters, gradients and optimizer state in fp32 at every precision:
  the half-precision copies made by autocast are transient (activations), not model
  states. The paper's mixed-precision Adam (fp16 parameters and gradients plus fp32
  master weights, momentum and variance: 2 + 2 + 12 bytes per parameter) is
  :func:`zero_paper_bytes_per_param`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIB = 2**20
FP32 = 4  # parameters, gradients and optimizer state at every precision (precision.STATE_BYTES)


def optimizer_state_bytes(optimizer_cfg, numels: Sequence[int], element: float = FP32) -> float:
    """Bytes of optimizer state for the given parameter tensors (``element`` bytes each)."""
    name = optimizer_cfg.name
    if name in ("adam", "adamw"):
        # exp_avg and exp_avg_sq per element, plus a 0-dim fp32 `step` per tensor
        return sum(2 * element * n + FP32 for n in numels)
    if name == "sgd":
        return sum(element * n for n in numels) if optimizer_cfg.momentum else 0
    raise ValueError(f"no memory model for optimizer {name!r}")


def predict_model_states_mib(
    memory,
    strategy_cfg,
    optimizer_cfg,
    group_shapes: Sequence[Sequence[tuple]],
    world_size: int,
    frozen: Sequence[tuple] = (),
    element: float = FP32,
    ranks: Sequence[int] | None = None,
) -> list[dict[str, float]]:
    """Predicted ``{"params", "grads", "optimizer"}`` MiB for every rank.

    ``memory``: the strategy's memory model (``Strategy.memory``); ``group_shapes``: the parameter shapes of each
    optimizer parameter group, in order; ``frozen``: the frozen parameters' shapes (held
    like the others, with no gradient and no optimizer state); ``element``: bytes per
    parameter element (gradients and optimizer state are in the parameters' dtype);
    ``ranks``: only these ranks (in that order), e.g. one when all are alike by construction.
    """
    shapes = [s for group in group_shapes for s in group]
    owners = memory.partition([[math.prod(s) for s in g] for g in group_shapes], world_size)
    out = []
    for rank in range(world_size) if ranks is None else ranks:
        held = memory.resident_numel(strategy_cfg, shapes, owners, rank, world_size)
        frozen_held = memory.resident_numel(strategy_cfg, frozen, [], rank, world_size)["params"] if frozen else 0
        out.append(
            {
                "params": element * (held["params"] + frozen_held) / MIB,
                "grads": element * held["grads"] / MIB,
                "optimizer": optimizer_state_bytes(optimizer_cfg, held["optimizer"], element) / MIB,
            }
        )
    return out


def largest_group_state_mib(
    memory, strategy_cfg, optimizer_cfg, group_shapes: Sequence[Sequence[tuple]], world_size: int, rank: int,
    element: float = FP32,
) -> float:  # fmt: skip
    """The optimizer state ``rank`` holds for its largest parameter group (MiB): a foreach
    optimizer steps one group at a time, so its step's temporaries (Adam's ``sqrt(v)``)
    follow the largest group's state, not the total."""
    owners = memory.partition([[math.prod(s) for s in g] for g in group_shapes], world_size)
    largest, start = 0.0, 0
    for group in group_shapes:
        mine = owners[start : start + len(group)]
        held = memory.resident_numel(strategy_cfg, list(group), mine, rank, world_size)
        largest = max(largest, optimizer_state_bytes(optimizer_cfg, held["optimizer"], element) / MIB)
        start += len(group)
    return largest


def zero_paper_bytes_per_param(stage: int, world_size: int, k: int = 12) -> float:
    """Model-state bytes per parameter per GPU in the ZeRO paper (mixed-precision Adam).

    Stage 0 is DDP: (2 + 2 + K). Stage 1 shards optimizer states, 2 adds gradients,
    3 adds parameters.
    """
    n = world_size
    return {
        0: 2 + 2 + k,
        1: 2 + 2 + k / n,
        2: 2 + (2 + k) / n,
        3: (2 + 2 + k) / n,
    }[stage]
