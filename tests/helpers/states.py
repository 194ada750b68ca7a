"""Saved model states compared: a run's ``model_final.pt`` against another run's."""

from __future__ import annotations

import torch


def max_relative_diff(path_a, path_b) -> float:
    """Largest per-tensor ||a - b|| / ||b||; a tensor that training leaves at its zero init
    up to rounding (key biases, |a - b| <= 1e-9 everywhere) counts as equal."""
    a = torch.load(path_a / "model_final.pt", weights_only=True)
    b = torch.load(path_b / "model_final.pt", weights_only=True)
    assert a.keys() == b.keys()
    diffs = []
    for k in b:
        delta = a[k].double() - b[k].double()
        diffs.append(0.0 if delta.abs().max() <= 1e-9 else (delta.norm() / b[k].double().norm()).item())
    return max(diffs)
