"""models/mlp.py: the MLP's layers (their sizes, its units) and its output and loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sharded_exp.models.mlp import MLP, MLPConfig, build


def test_the_parameter_count_is_the_layers_linear_and_norm_sizes():
    i, h, d, c = 6, 10, 3, 4
    model = build(MLPConfig(in_features=i, hidden=h, depth=d, num_classes=c))
    first = i * h + h
    later = (d - 1) * (h * h + h)
    norms = d * 2 * h
    head = h * c + c
    assert sum(p.numel() for p in model.parameters()) == first + later + norms + head


def test_each_unit_is_one_linear_gelu_layernorm_layer():
    model = MLP(MLPConfig(in_features=6, hidden=10, depth=3, num_classes=4))
    layers = model.sharding_units()
    assert len(layers) == 3
    assert [type(m).__name__ for m in layers[1]] == ["Linear", "GELU", "LayerNorm"]
    assert layers[0][0].in_features == 6 and layers[2][0].in_features == 10


def test_the_output_is_the_logits_and_the_cross_entropy_loss_only_with_targets():
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=6, hidden=10, depth=2, num_classes=4))
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0])
    out = model(inputs=x, targets=y)
    assert out.logits.shape == (5, 4)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits, y))
    assert model(inputs=x).loss is None
