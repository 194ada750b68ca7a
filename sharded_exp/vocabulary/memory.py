"""What each kind of memory is called: torch's tracker names, ours, and how tables and charts show them.

A rank's peak is split into categories in three places that must agree: torch's MemTracker files
live tensors under its own names (``Parameter``, ``Optstate``, ...), the fake step and the planner
file them under ours (``params``, ``optimizer``, ...), and the report's chart folds both into five
bars. Each mapping lives here once, so a new category is added in one module, not five.
"""

from __future__ import annotations

TOTAL = "Total"
"""The key torch's tracker snapshot gives the sum of every category."""

BUCKET = "Bucket"
"""Our category beside torch's (Parameter, Gradient, Optstate, Activation, Temp, ...): the
communication buckets a strategy allocates when it wraps the model (DDP's gradient
all-reduce buckets, ShardedDDP's reduce buckets), live for the whole run."""

OWN_CATEGORIES = (
    BUCKET,  # a strategy's communication buckets
)
"""Our tracker categories beside torch's. The CPU tracker files a tensor allocated inside
``filed_as(name)`` (:func:`sharded_exp.measure.tracker.filed_as`) under ``name``, which must be
one of these. A new one also needs its line in :data:`TORCH_CATEGORIES` (ours for it), a
part in :data:`PARTS` with a meaning in :data:`MEANINGS`, and a chart bar
(docs/development/add-a-memory-category.md walks through it)."""

TEMP = "Temp"
"""torch's tracker name for what the backward allocates that is no parameter's gradient
(``temporaries`` in ours): the probe files DDP's backward copy of the gradients under it, as
a run's tracker does."""

TORCH_CATEGORIES = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "gathered",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    TEMP: "temporaries",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
    "Buffer": "other",
    BUCKET: "buckets",
    "Other": "other",
}
"""torch's tracker categories (MemTracker's; FSDPMemTracker's too) -> ours. The order of first
appearance of each of ours is the order of the fake step's breakdown (result.json keeps it)."""

MODEL_STATES = ("params", "grads", "optimizer")
"""The model states (``model_states_mib``): what a rank holds between steps, by formula or measured."""

OTHER = "other"
"""Ours for a tracker category this table does not know."""


def in_our_names(parts: dict[str, float]) -> dict[str, float]:
    """A split by torch's tracker categories (MiB) as ours (:data:`TORCH_CATEGORIES`, a name
    it does not know as :data:`OTHER`), those that are one of ours summed, in order of first
    appearance: what a prediction writes to result.json."""
    out: dict[str, float] = {}
    for name, mib in parts.items():
        ours = TORCH_CATEGORIES.get(name, OTHER)
        out[ours] = out.get(ours, 0.0) + mib
    return out


OPTIMIZER_STEP = "optimizer_step"
"""The optimizer step's temporaries (foreach Adam's sqrt(v)), kept apart from its state."""

PARTS = (
    "params",
    "grads",
    "optimizer",
    OPTIMIZER_STEP,
    "gathered",
    "buckets",
    "activations",
    "temporaries",
    "communication",
    OTHER,
    "workspace",
)
"""The parts of a rank's peak as the planner and the report name them (each plan row's
``<part>_gib``), in table order: optimizer state apart from the optimizer step's temporaries,
communication buckets apart from activations."""

HEADINGS = {"optimizer": "optim state", OPTIMIZER_STEP: "optim step", "communication": "comm"}
"""A part's column heading where it differs from its key."""


def heading(part: str) -> str:
    """A part's column heading (its key unless :data:`HEADINGS` says otherwise)."""
    return HEADINGS.get(part, part)


MEANINGS = {
    "params": "parameters this rank holds",
    "grads": "gradients",
    "optim state": "optimizer state (Adam's two moments)",
    "optim step": "the optimizer step's temporaries (foreach Adam's sqrt(v))",
    "gathered": "parameters gathered whole for a unit's compute (FSDP)",
    "buckets": "communication buckets (DDP's all-reduce, ShardedDDP's reduce)",
    "activations": "activations kept for the backward",
    "temporaries": "forward/backward temporaries",
    "comm": "collective buffers in flight",
    "workspace": "cuBLAS workspace (CUDA)",
}
"""What each part's column holds, by heading (the plan's legend)."""

CHART_BUCKETS = "communication buckets"
"""The chart bar of a strategy's communication buckets (:data:`BUCKET`). Drawn apart, not folded into
the rest: under ShardedDDP at 4 ranks they are most of the peak, and a grey bar hid them."""
CHART_PARTS = ("parameters", "gradients", "optimizer state", CHART_BUCKETS, "activations", "temporaries, other")
"""The report chart's six bars, bottom to top: every category folds into one of them."""
CHART_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#8C8C8C")
"""Each of :data:`CHART_PARTS`' colour, in the same order."""
CHART_REST = CHART_PARTS[-1]
"""The bar a category no table below names goes to."""

MEASURED_CHART_PARTS = {  # torch's MemTracker categories (result.json per_rank peak_breakdown_mib)
    "Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer state", "Activation": "activations",
    BUCKET: CHART_BUCKETS, TEMP: CHART_REST, "Buffer": CHART_REST, "Other": CHART_REST,
}  # fmt: skip
"""A measured breakdown's category (torch's name) -> its chart bar."""

PREDICTED_CHART_PARTS = {  # the fake step's (result.json memory.peak_prediction.breakdown_mib)
    # the optimizer step's temporaries with the state: the CPU tracker files both as optimizer memory
    "params": "parameters", "gathered": "parameters", "grads": "gradients", "optimizer": "optimizer state",
    OPTIMIZER_STEP: "optimizer state",
    "buckets": CHART_BUCKETS, "activations": "activations", "temporaries": CHART_REST, "communication": CHART_REST,
    OTHER: CHART_REST, "workspace": CHART_REST,
}  # fmt: skip
"""A predicted breakdown's category (ours) -> its chart bar."""
