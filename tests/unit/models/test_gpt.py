"""models/gpt.py: the GPT's parameter sizes and units, the head-divisibility check, causal
attention and its loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharded_exp.errors import ConfigError
from sharded_exp.models.gpt import GPTConfig, build

CFG = GPTConfig(vocab_size=11, seq_len=6, d_model=8, n_layers=3, n_heads=2, mlp_ratio=3)


def test_the_parameter_count_is_embeddings_blocks_final_norm_and_an_untied_head():
    v, t, d, n, r = 11, 6, 8, 3, 3
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * r * d + r * d) + (r * d * d + d)
    model = build(CFG)
    assert sum(p.numel() for p in model.parameters()) == v * d + t * d + n * block + 2 * d + d * v
    assert model.head.weight is not model.tok_emb.weight


def test_the_units_are_the_transformer_blocks_each_the_same_size():
    model = build(CFG)
    blocks = model.sharding_units()
    assert len(blocks) == 3 and all(type(b).__name__ == "Block" for b in blocks)
    assert len({sum(p.numel() for p in b.parameters()) for b in blocks}) == 1


def test_a_width_the_heads_do_not_divide_is_refused():
    with pytest.raises(ConfigError, match="d_model=10 is not divisible by model.n_heads=4"):
        build(GPTConfig(d_model=10, n_heads=4))


def test_a_later_token_never_changes_an_earlier_positions_logits():
    torch.manual_seed(0)
    model = build(CFG).eval()
    ids = torch.randint(0, 11, (2, 6))
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 11
    a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_the_loss_is_the_cross_entropy_over_every_position():
    torch.manual_seed(0)
    model = build(CFG)
    ids, targets = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    out = model(input_ids=ids, targets=targets)
    assert out.logits.shape == (2, 5, 11)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits.reshape(10, 11), targets.reshape(10)))
    assert model(input_ids=ids).loss is None
