"""A user's own models (``model=custom model._target_=tests.helpers.user_models.build``), importable
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


class ExitsInForward(Net):
    """A model that ends its rank's process from inside forward on the ranks named in
    ``ranks`` (never in the parent's fake step): ``sys.exit(code)`` or ``os._exit(code)``."""

    def __init__(self, in_features, num_classes, how, code, ranks):
        super().__init__(in_features, num_classes, 16)
        self.how, self.code, self.ranks = how, code, list(ranks)

    def forward(self, inputs, targets=None):
        import os
        import sys

        import torch.distributed as dist
        from torch._subclasses.fake_tensor import FakeTensor

        real = not isinstance(inputs, FakeTensor) and inputs.device.type != "meta"  # not pre-flight's fake step
        if real and dist.is_initialized() and dist.get_rank() in self.ranks:
            sys.stdout.flush()
            sys.exit(self.code) if self.how == "sys" else os._exit(self.code)
        return super().forward(inputs, targets)


def build_exits(in_features, num_classes, how="os", code=0, ranks=(0, 1)):
    return ExitsInForward(in_features, num_classes, how, code, ranks)


class WithScalar(Net):
    """A model with a 0-dim parameter (a learnable temperature), as in CLIP."""

    def __init__(self, in_features, num_classes):
        super().__init__(in_features, num_classes, 16)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, inputs, targets=None):
        out = super().forward(inputs, targets)
        logits = out["logits"] * self.temperature
        return {"logits": logits, "loss": F.cross_entropy(logits, targets)}


def build_with_scalar(in_features, num_classes):
    return WithScalar(in_features, num_classes)


def build_none(in_features, num_classes):
    """A factory that forgot its return."""
    Net(in_features, num_classes, 16)


def build_not_a_module(in_features, num_classes):
    return {"weights": torch.zeros(in_features, num_classes)}


class WithUnused(Net):
    """A model with a branch its forward never takes (an auxiliary head left in place)."""

    def __init__(self, in_features, num_classes):
        super().__init__(in_features, num_classes, 16)
        self.aux_head = nn.Linear(16, num_classes)


def build_with_unused(in_features, num_classes):
    return WithUnused(in_features, num_classes)


class Double(Net):
    def forward(self, inputs, targets=None):
        return super().forward(inputs.double(), targets)


def build_double(in_features, num_classes):
    """A model in float64 (numerical work, or a dtype left by mistake)."""
    return Double(in_features, num_classes, 16).double()


class WithBatchNorm(Net):
    """BatchNorm between the layers: running statistics are buffers, updated in training."""

    def __init__(self, in_features, num_classes):
        super().__init__(in_features, num_classes, 16)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, inputs, targets=None):
        x = self.norm(torch.relu(self.layers[0](inputs)))
        logits = self.head(torch.relu(self.layers[1](x)))
        return {"logits": logits, "loss": F.cross_entropy(logits, targets)}


def build_with_batchnorm(in_features, num_classes):
    return WithBatchNorm(in_features, num_classes)


class RaisesInForward(Net):
    """A model whose forward raises RuntimeError(message) in the real ranks (as a CUDA
    library would), never in the parent's fake step."""

    def __init__(self, in_features, num_classes, message):
        super().__init__(in_features, num_classes, 16)
        self.message = message

    def forward(self, inputs, targets=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(inputs, FakeTensor) and inputs.device.type != "meta":
            raise RuntimeError(self.message)
        return super().forward(inputs, targets)


def build_raises(in_features, num_classes, message="boom"):
    return RaisesInForward(in_features, num_classes, message)


class TiedDouble(Double):
    """float64 with its head tied to its first layer (as an LM head to its embedding)."""

    def __init__(self, in_features, num_classes):
        super().__init__(in_features, num_classes, in_features)
        self.layers[1] = nn.Linear(in_features, in_features)
        self.head = nn.Linear(in_features, num_classes)
        self.extra = nn.Linear(in_features, in_features)
        self.extra.weight = self.layers[1].weight  # tied


def build_tied_double(in_features, num_classes):
    return TiedDouble(in_features, num_classes).double()


class Flat(nn.Module):
    """No repeated units (no sharding_units(), no ModuleList or Sequential): nothing for per-unit levers."""

    def __init__(self, in_features, num_classes):
        super().__init__()
        self.first = nn.Linear(in_features, 16)
        self.head = nn.Linear(16, num_classes)

    def forward(self, inputs, targets=None):
        logits = self.head(torch.relu(self.first(inputs)))
        return {"logits": logits, "loss": F.cross_entropy(logits, targets)}


class Blocks(nn.Module):
    """A common layout: the repeated layers in ``self.blocks`` (timm's ViT keeps them there), a
    name that must not be taken for a method of this project's."""

    def __init__(self, in_features, num_classes, hidden):
        super().__init__()
        self.first = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(3)])
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, inputs, targets=None):
        x = torch.relu(self.first(inputs))
        for block in self.blocks:
            x = x + torch.relu(block(x))
        logits = self.head(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, targets)}


def build_blocks(in_features, num_classes):
    return Blocks(in_features, num_classes, 16)


def build_flat(in_features, num_classes):
    return Flat(in_features, num_classes)


class _NoParameters(torch.nn.Module):
    def forward(self, inputs, targets):
        return {"loss": inputs.sum() * 0, "logits": inputs}


def build_without_parameters(in_features, num_classes):
    """A model with no parameter at all: nothing to train, refused before spawn."""
    return _NoParameters()


class OutOfMemoryInEvaluation(Net):
    """Trains; runs out of memory (as torch raises it) as soon as it is evaluated."""

    def forward(self, inputs, targets=None):
        if not self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test model)")
        return super().forward(inputs, targets)


def build_oom_in_evaluation(in_features, num_classes):
    return OutOfMemoryInEvaluation(in_features, num_classes, 16)


class ReadsAValue(Net):
    """A constructor that reads a parameter's value (as torch's orthogonal parametrization
    does, through Tensor.item()): it builds in plain torch, not on the meta device."""

    def __init__(self, in_features, num_classes, hidden):
        super().__init__(in_features, num_classes, hidden)
        self.register_buffer("scale", torch.tensor(1.0 / max(1e-6, next(self.parameters()).abs().max().item())))


def build_reading_a_value(in_features, num_classes, hidden=16):
    return ReadsAValue(in_features, num_classes, hidden)


class ParameterInForward(Net):
    """A forward that registers a parameter the first time it runs (a scale made on demand):
    the optimizer never sees it, and FSDP cannot shard it."""

    def forward(self, inputs, targets=None):
        if not hasattr(self, "late_scale"):
            self.late_scale = nn.Parameter(torch.ones((), device=inputs.device))
        out = super().forward(inputs, targets)
        return {"logits": out["logits"] * self.late_scale, "loss": out["loss"] * self.late_scale}


def build_parameter_in_forward(in_features, num_classes):
    return ParameterInForward(in_features, num_classes, 16)


class FailsInForward(Net):
    """A model whose forward raises ValueError(message) everywhere, the fake step included,
    after its first layer ran (under FSDP2, with its parameters gathered)."""

    def __init__(self, in_features, num_classes, message):
        super().__init__(in_features, num_classes, 16)
        self.message = message

    def forward(self, inputs, targets=None):
        torch.relu(self.layers[0](inputs))
        raise ValueError(self.message)


def build_fails(in_features, num_classes, message="cannot handle these shapes"):
    return FailsInForward(in_features, num_classes, message)
