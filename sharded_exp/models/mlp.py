"""MLP classifier: the smallest model on which every strategy can be told apart."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sharded_exp.config import Sealed
from sharded_exp.models import MODELS, ModelOutput


@dataclass
class MLPConfig(Sealed):
    name: str = "mlp"
    in_features: int = 64
    """Input width; the teacher task draws vectors of this size."""
    hidden: int = 256
    """Width of every hidden layer."""
    depth: int = 3
    """Hidden layers, each Linear -> GELU -> LayerNorm."""
    num_classes: int = 10
    """Output classes (the teacher task labels inputs with this many)."""


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        layers, width = [], cfg.in_features
        for _ in range(cfg.depth):
            layers.append(nn.Sequential(nn.Linear(width, cfg.hidden), nn.GELU(), nn.LayerNorm(cfg.hidden)))
            width = cfg.hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, cfg.num_classes)

    def sharding_units(self) -> list:
        """The repeated layer groups (units that FSDP shards and gathers one at a time)."""
        return list(self.body)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor = None) -> ModelOutput:
        logits = self.head(self.body(inputs))
        loss = None if targets is None else F.cross_entropy(logits.float(), targets)
        return ModelOutput(logits, loss)


@MODELS.register("mlp", config=MLPConfig)
def build(cfg: MLPConfig) -> nn.Module:
    return MLP(cfg)
