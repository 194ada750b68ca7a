"""sharded_exp/train/build.py: build_run assembles a run (the task, the levers, the strategy,
autocast) around the model's build; a model registered by a plugin starts from its
constructor's own values under every strategy, and the hooks see the build where promised."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sharded_exp.compose import compose
from sharded_exp.models import MODELS, ModelOutput
from sharded_exp.train import build

SEED = 11


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Base(nn.Module):
    """A small classifier for the MLP's task (inputs [batch, 64] -> 10 classes), with two
    repeated blocks: the units a strategy shards."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 16)
        self.blocks = nn.ModuleList([_Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def sharding_units(self):
        return list(self.blocks)

    def forward(self, inputs, targets=None):
        x = self.inp(inputs)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        return ModelOutput(logits, loss)


class _HalfReset(nn.Linear):
    """A layer whose reset_parameters leaves its bias untouched."""

    def reset_parameters(self):
        nn.init.normal_(self.weight)


class HalfReset(_Base):
    def __init__(self):
        super().__init__()
        self.head = _HalfReset(16, 10)
        nn.init.constant_(self.head.bias, 2.0)


class BufferFromWeight(_Base):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", self.head.weight.detach().abs().mean(0).clone())


class OwnInit(_Base):
    """A constructor's own initialisation: a zeroed head, biases at 0.25."""

    def __init__(self):
        super().__init__()
        nn.init.zeros_(self.head.weight)
        for block in self.blocks:
            nn.init.constant_(block.linear.bias, 0.25)


class RootResets(_Base):
    """A root reset_parameters that re-initialises its blocks."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.temperature)
        for block in self.blocks:
            nn.init.uniform_(block.linear.weight, -0.01, 0.01)


HOSTILE = [HalfReset, BufferFromWeight, OwnInit, RootResets]


@pytest.fixture
def registered(monkeypatch):
    """Register a model class as a plugin would (MODELS.register from a module of its own)."""

    def register(cls, strategy: str = "ddp") -> object:
        def builder(cfg):
            return cls()

        builder.__module__ = "my_plugin.models"
        monkeypatch.setitem(MODELS._entries, "hostile", (builder, MODELS.config_class("mlp")))
        cfg = compose([f"strategy={strategy}", "trainer.batch_size=4", f"trainer.seed={SEED}"], "config")
        cfg.model.name = "hostile"
        return cfg

    return register


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    state = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }
    state.update({n: b.detach().clone() for n, b in module.named_buffers()})
    return state


@pytest.mark.parametrize("cls", HOSTILE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_plugin_model_starts_from_its_constructors_values_under_every_strategy(cls, strategy, registered, gloo_group):
    cfg = registered(cls, strategy)
    torch.manual_seed(SEED)
    expected = _weights(cls())  # what the user's constructor makes, with the job's seed
    run = build.build_run(cfg, torch.device("cpu"), with_task=False)
    assert run.build == "whole"
    got = _weights(run.module)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), (cls.__name__, strategy, name)


def test_the_hooks_see_the_skeleton_before_wrapping_and_the_initial_weights_after(gloo_group):
    cfg = compose(["strategy=ddp", "trainer.batch_size=4", f"trainer.seed={SEED}", "precision=bf16"], "config")
    seen = {}
    run = build.build_run(
        cfg,
        torch.device("cpu"),
        before_wrap=lambda module: seen.update(before=all(p.is_meta for p in module.parameters())),
        after_build=lambda strategy: seen.update(after=strategy),
    )
    assert seen == {"before": True, "after": run.strategy}
    assert run.build == "units" and run.task is not None
    with run.autocast:
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16
