"""A small GPT-style decoder-only transformer (pre-norm blocks, causal attention).

Untied input embedding and output head, so every parameter is a distinct tensor and the
memory accounting of sharded strategies stays exact.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sharded_exp.config import Sealed, bounded, check_bounds, check_model_sizes
from sharded_exp.models import MODELS, ModelOutput


@dataclass
class GPTConfig(Sealed):
    name: str = "gpt"
    vocab_size: int = 256
    """Token vocabulary; the Markov task draws tokens from it."""
    seq_len: int = 64
    """Tokens per sample, also the length of the learned position table."""
    d_model: int = bounded(128, multiple_of="n_heads")
    """Residual stream width."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP as a multiple of d_model."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks_ = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def sharding_units(self) -> list:
        """The transformer blocks (units that FSDP shards and gathers one at a time)."""
        return list(self.blocks_)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor = None) -> ModelOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        for block in self.blocks_:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            # float() so the loss is computed in fp32 under autocast, as nanoGPT does
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return ModelOutput(logits, loss)


@MODELS.register("gpt", config=GPTConfig)
def build(cfg: GPTConfig) -> nn.Module:
    check_model_sizes(cfg)  # a library call's config too (a node or the dataclass): the command line's rules
    check_bounds("model", cfg, GPTConfig)
    return GPT(cfg)
