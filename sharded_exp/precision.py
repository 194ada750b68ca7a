"""Precision, in one place: compute dtype, bytes per value, autocast and the grad scaler.

32 runs without autocast. 16 autocasts to float16 and scales the loss dynamically.
bf16 autocasts to bfloat16 and needs no scaler (its exponent range matches fp32).
Parameters, gradients and optimizer state stay fp32 in all three (torch AMP keeps the
fp32 master weights as the parameters themselves): :data:`STATE_BYTES`.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = {"32": None, "16": torch.float16, "bf16": torch.bfloat16}
"""Option name -> autocast dtype (None: no autocast)."""
STATE_BYTES = 4
"""Bytes per value of parameters, gradients and optimizer state at every precision."""


def compute_dtype(name: str) -> torch.dtype | None:
    """The dtype autocast (or FSDP's MixedPrecisionPolicy) computes in; None for fp32."""
    return PRECISIONS[str(name)]


def compute_bytes(name: str) -> int:
    """Bytes per value of activations and gathered parameters at this precision."""
    dtype = compute_dtype(name)
    return 4 if dtype is None else dtype.itemsize


def autocast(cfg, device_type: str) -> contextlib.AbstractContextManager:
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
    kwargs = {
        "init_scale": cfg.init_scale,
        "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
        "enabled": cfg.name == "16",
    }
    if sharded_grads and kwargs["enabled"]:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
