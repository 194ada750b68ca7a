"""Model states compared: one run's parameters against another's (parity against DDP)."""

from __future__ import annotations

from pathlib import Path

import torch

ZERO_INIT_ATOL = 1e-9
"""Elementwise differences up to this are rounding of a tensor that training leaves at zero."""


def model_state(source) -> dict[str, torch.Tensor]:
    """A state dict as given, or the ``model_final.pt`` of a run directory."""
    if isinstance(source, (str, Path)):
        return torch.load(Path(source) / "model_final.pt", weights_only=True)
    return source


def max_relative_diff(a, b, atol: float = ZERO_INIT_ATOL) -> float:
    """Largest per-tensor ``||a - b|| / ||b||`` over two model states (state dicts, or run
    directories holding ``model_final.pt``), which must name the same tensors.

    A pair whose elements all differ by at most ``atol`` counts as equal (0.0): a tensor that
    training leaves at its zero init up to rounding has no meaningful relative difference
    (attention key biases: their gradient is zero in exact arithmetic). Beyond ``atol`` a zero
    reference gives ``inf``, never a silent 0/0; ``atol=0`` exempts identical tensors only."""
    a, b = model_state(a), model_state(b)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = 0.0
    for key in b:
        delta = a[key].double() - b[key].double()
        if delta.numel() == 0 or delta.abs().max().item() <= atol:
            continue
        norm = b[key].double().norm().item()
        worst = max(worst, delta.norm().item() / norm if norm > 0 else float("inf"))
    return worst
