"""Precision, in one place: its names, compute dtype, bytes per value, autocast and the grad scaler.

32 runs without autocast. 16 autocasts to float16 and scales the loss dynamically.
bf16 autocasts to bfloat16 and needs no scaler (its exponent range matches fp32).
Parameters, gradients and optimizer state stay fp32 in all three (torch AMP keeps the
fp32 master weights as the parameters themselves): :data:`STATE_BYTES`.

Every spelling of a precision this project accepts (its option name, its alias option, and
:data:`SPELLINGS`) is read by one parser, :meth:`Precision.parse`: the command line's
alias options (``precision=fp16``, stored from :func:`alias_options`), the probe's parameter
dtype, Lightning's ``"16-mixed"``; the Hugging Face Trainer's flags name a member. What a
run records is the option's own name, :attr:`Precision.value` (``"32"``, ``"16"``, ``"bf16"``).

torch is imported where a dtype or an autocast is made, not at the top: the command line
composes the config (``--help``, tab completion) without importing torch.
"""

from __future__ import annotations

import contextlib
from enum import Enum

from sharded_exp.errors import ConfigError


class Precision(str, Enum):
    """A precision, by the option name a run records (``Precision.fp16.value == "16"``).
    The member names are the group's alias options: Hydra reads a bare ``16`` on the command
    line as an int, which no group option can be, so ``fp16`` names the same option.

    A member reads as its option name wherever a string is wanted (``str()``, an f-string,
    ``== "16"``, a dict keyed by names), as the config's :class:`~sharded_exp.config.Option`
    members do: code handed one never unwraps it."""

    fp32 = "32"
    fp16 = "16"
    bf16 = "bf16"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls, cfg) -> Precision:
        """The precision a job's config runs at: the whole config (``cfg.precision`` is its
        group), composed or typed. The one reader of ``precision.name`` outside pre-flight's
        check of it: every other module asks here."""
        return cls.parse(cfg.precision.name)

    @classmethod
    def parse(cls, value) -> Precision:
        """The precision ``value`` spells: an option name or alias, a number, one of
        Lightning's spellings, a torch dtype (see :data:`SPELLINGS`). Raises ConfigError
        naming the value and every spelling allowed."""
        if isinstance(value, cls):
            return value
        key = str(value).removeprefix("torch.")  # torch.float16 -> float16
        if key not in _BY_SPELLING:
            raise ConfigError(f"precision {value!r} is not one of: {', '.join(_BY_SPELLING)}")
        return _BY_SPELLING[key]

    @property
    def autocast_dtype(self):
        """The dtype autocast (or FSDP's MixedPrecisionPolicy) computes in; None for fp32."""
        import torch  # lazy: torch, not before Hydra's questions are answered (see the module docstring)

        return None if self is Precision.fp32 else getattr(torch, SPELLINGS[self][-1])

    @property
    def lightning(self) -> str:
        """Lightning's ``Trainer(precision=...)`` for this precision (mixed: fp32 weights)."""
        return SPELLINGS[self][0]


SPELLINGS: dict[Precision, tuple[str, ...]] = {
    Precision.fp32: ("32-true", "float32"),
    Precision.fp16: ("16-mixed", "16-true", "float16"),
    Precision.bf16: ("bf16-mixed", "bf16-true", "bfloat16"),
}
"""Each precision's spellings besides its option name and its member name (``16``, ``fp16``):
Lightning's (the one it means first: mixed precision keeps fp32 weights), then torch's dtype
name. Numbers (``16``) and torch dtypes (``torch.float16``) are read through their text."""
_BY_SPELLING = {s: p for p in Precision for s in (p.value, p.name, *SPELLINGS[p])}

PRECISIONS = tuple(p.value for p in Precision)
"""The precision options by name (``32``, ``16``, ``bf16``): what a run records. Their
dtypes are :func:`compute_dtype`'s."""
STATE_BYTES = 4
"""Bytes per value of parameters, gradients and optimizer state at every precision."""


def alias_options() -> dict[str, str]:
    """The config group's options that name another option (``fp16`` -> ``16``): the
    member names that are not their option's name."""
    return {p.name: p.value for p in Precision if p.name != p.value}


def compute_dtype(name):
    """The dtype autocast (or FSDP's MixedPrecisionPolicy) computes in; None for fp32."""
    return Precision.parse(name).autocast_dtype


PARAM_PRECISIONS = {"bfloat16": "bf16", "float16": "16"}
"""A strategy's own parameter dtype (FSDP's ``strategy.param_dtype``) as the precision it computes at."""


def step_precision(cfg) -> str:
    """The precision a job's matmuls run at (the whole config, composed or typed): autocast's
    where its precision has one; else the dtype a strategy's own mixed-precision policy gathers
    the parameters in (FSDP's ``strategy.param_dtype``: FSDP2 casts the forward's inputs to it
    too), so ``precision=32 strategy.param_dtype=bfloat16`` computes in bf16; else fp32 ("32")."""
    name = str(Precision.of(cfg))
    if compute_dtype(name) is not None:
        return name
    param = getattr(cfg.strategy, "param_dtype", None)
    return PARAM_PRECISIONS.get(str(param), name)


def compute_bytes(name) -> int:
    """Bytes per value of activations and gathered parameters at this precision."""
    dtype = compute_dtype(name)
    return 4 if dtype is None else dtype.itemsize


def autocast(cfg, device_type: str) -> contextlib.AbstractContextManager:
    import torch  # lazy: torch, not before Hydra's questions are answered (see the module docstring)

    dtype = compute_dtype(cfg.name)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def grad_scaler(cfg, device_type: str, sharded_grads: bool):
    """A GradScaler, enabled only for precision=16.

    Warning:
        When gradients or optimizer updates are sharded, ranks see different gradients, and
        a rank whose shard holds an inf would skip the step while its peers apply theirs:
        the shards desynchronise. ``sharded_grads=True`` returns torch's ShardedGradScaler,
        which all-reduces the found-inf flag so every rank makes the same decision.
        fairscale's own ShardedGradScaler is not used: it disables itself without CUDA.
    """
    import torch  # lazy: torch, not before Hydra's questions are answered (see the module docstring)

    kwargs = {
        "init_scale": cfg.init_scale,
        "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
        "enabled": cfg.name == "16",
    }
    if sharded_grads and kwargs["enabled"]:
        import warnings  # lazy: only for the sharded scaler

        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # lazy: torch (as above)

        # torch's ShardedGradScaler unscales DTensor gradients by its scale of shape (1,), and
        # DTensor warns of that implicit replication at every step: torch's own use, nothing
        # a run could change, printed twice into a job's output otherwise
        warnings.filterwarnings(
            "ignore", message="Found a non-scalar tensor with numel=1 and ndim!=0", category=UserWarning
        )
        return ShardedGradScaler(device=device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
