"""What a strategy is, as frozen facts: how much it shards, how it checkpoints and clears
gradients, what it needs installed and which wrappers give it away.

Every module that must know something about a strategy without building it (the report's
order and baseline, the planner, the checkpoint policy, the probe) reads these facts,
never the strategy's name. They are data, so reading them imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharded_exp.config import GradZeroing, ZeroGrad


@dataclass(frozen=True)
class Traits:
    """One strategy's facts (``Strategy.traits``)."""

    sharding: int = 0
    """How much of the model state the ranks divide among them, to order strategies from
    the least sharded (reports, the planner's "cheapest that fits"): 0 nothing (DDP),
    1 the optimizer state (OSS, ZeRO-1), 2 and the gradients (ShardedDDP), 3 and the
    parameters outside forward and backward (FSDP's SHARD_GRAD_OP), 4 everything (FSDP)."""
    shards_parameters: bool = False
    """True when no rank holds the whole model (FSDP2): nothing may gather it onto one rank
    unasked, and checkpoints default to the sharded format."""
    optimizer_state_sharded: bool = False
    """True when each rank's local optimizers hold the state of its own parameters only
    (OSS, ZeRO-1): checkpoints gather the shards, the memory model counts the owned ones.
    FSDP2's DTensor state is sharded as tensors instead."""
    checkpoint_format: str | None = None
    """``trainer.checkpoint_format=auto``; None: consolidated (one full copy, written by rank
    0) where one rank holds everything, dcp (each rank its own shards) where the strategy
    shards something, as the product cannot know that one rank could hold it all
    (:attr:`checkpoint_format_auto`)."""
    host_offload: str | None = None
    """The config setting that keeps model states in host memory (FSDP's ``cpu_offload``);
    None: the strategy never does."""
    requires: tuple[str, ...] = ()
    """Packages beyond our core dependencies that the strategy imports (checked in pre-flight,
    before spawn; a built-in strategy takes them from its config class's ``REQUIRES``, which
    the command line holds before torch is imported)."""
    wrappers: tuple[str, ...] = ()
    """The classes whose instance on a user's model (or any module in it) or optimizer says
    this strategy runs (the probe's reading), by the dotted name they are imported under:
    a class matches when it has that name and is defined in that package or below it.
    ``Name:VALUE`` matches only where the wrapper's ``sharding_strategy`` is VALUE (FSDP1)."""
    baseline: bool = False
    """The strategy every other one is compared with (DDP: nothing sharded)."""
    clip_reads_values: bool = False
    """True when clipping branches on the norm's value (fairscale OSS): a fake step, which
    has no values, then runs without clipping (it scales in place: no memory)."""
    grads_differ_across_ranks: bool = False
    """True when ranks check different gradients for inf/nan (sharded gradients or sharded
    optimizer steps): the grad scaler must then agree on the found-inf flag across ranks."""
    zero_grad_fixed: ZeroGrad | None = None
    """The one rule by which the strategy clears gradients, whatever ``trainer.zero_grad``
    asks (ShardedDDP: zeros in place), with its reason in ``zero_grad_fixed_reason``; None:
    it follows ``trainer.zero_grad``."""
    zero_grad_fixed_reason: str = ""

    @property
    def checkpoint_format_auto(self) -> str:
        """The format ``trainer.checkpoint_format=auto`` takes."""
        if self.checkpoint_format is not None:
            return self.checkpoint_format
        return "dcp" if self.shards_parameters or self.optimizer_state_sharded else "consolidated"

    def offloads_to_host(self, cfg) -> bool:
        """Does the strategy, as ``cfg`` (its config group) sets it, keep model states in host memory?"""
        return self.host_offload is not None and bool(cfg.get(self.host_offload, False))

    def zero_grad_rule(self, requested: ZeroGrad) -> GradZeroing:
        """The rule the strategy applies when ``trainer.zero_grad`` asks for ``requested``."""
        if self.zero_grad_fixed is None or self.zero_grad_fixed is requested:
            return GradZeroing(requested, requested)
        return GradZeroing(requested, self.zero_grad_fixed, self.zero_grad_fixed_reason)


def defines(cls: type, dotted: str) -> bool:
    """Is ``cls`` the class ``dotted`` names (same name, defined in that package or below)?"""
    package, _, name = dotted.rpartition(".")
    module = getattr(cls, "__module__", "") or ""
    return cls.__name__ == name and (module == package or module.startswith(package + "."))


def wrapped_by(traits: Traits, classes: list[type], sharding_strategy: str | None) -> str | None:
    """The first of ``traits.wrappers`` that one of ``classes`` (the model's modules' and the
    optimizer's classes, their bases included) matches, or None.
    ``sharding_strategy``: FSDP1's, if found."""
    for wrapper in traits.wrappers:
        dotted, _, value = wrapper.partition(":")
        if value and value != sharding_strategy:
            continue
        if any(defines(cls, dotted) for cls in classes):
            return wrapper
    return None
