"""A user's own models (``model=custom model._target_=tests.user_models.build``), importable
by every rank of an in-process job; ``tests/conftest.py``'s ``user_module`` copies this file
out as ``my_models`` for jobs started as a user would, outside the repository."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, in_features, num_classes, hidden):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(in_features, hidden), nn.Linear(hidden, hidden)])
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, inputs, targets=None):
        x = inputs
        for layer in self.layers:
            x = torch.relu(layer(x))
        logits = self.head(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, targets)}


class NoLoss(Net):
    def forward(self, inputs, targets=None):
        return {"logits": self.head(torch.relu(self.layers[0](inputs)))}


class OnlyX(Net):
    def forward(self, x):
        return {"logits": self.head(x)}


def build(in_features, num_classes, hidden=16):
    return Net(in_features, num_classes, hidden)


def build_no_loss(in_features, num_classes):
    return NoLoss(in_features, num_classes, 16)


def build_only_x(in_features, num_classes):
    return OnlyX(in_features, num_classes, 16)
