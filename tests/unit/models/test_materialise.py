"""sharded_exp/models/materialise.py: which rule builds a model, and the unit-by-unit
initialisation's refusals, naming the parameter, wherever it would change initial weights
silently (a parameter its reset leaves unwritten, a root reset writing its blocks, a buffer
computed from a weight); a sound model has every parameter written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sharded_exp.compose import compose
from sharded_exp.errors import ConfigError
from sharded_exp.models import ModelOutput, materialise

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


def test_the_builtin_models_and_hugging_face_classes_keep_the_unit_by_unit_build():
    assert materialise.build_rule(compose(["model=gpt"]).model) == "units"
    assert materialise.build_rule(compose(["model=mlp"]).model) == "units"
    assert materialise.build_rule(compose(["model=hf_llama"]).model) == "units"
    assert materialise.build_rule(compose(["model=custom", "model._target_=torch.nn.Linear"]).model) == "whole"


def _skeleton(cls) -> nn.Module:
    with torch.device("cpu"), materialise.parameters_on_meta():
        return cls()


def test_a_parameter_its_reset_leaves_unwritten_is_refused_by_name():
    module = _skeleton(HalfReset)
    materialise.materialise(module, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"model parameter head\.bias \(_HalfReset\) is not written by its init"):
        materialise.initialise_by_unit(module, seed=SEED, host=torch.device("cpu"))


def test_a_root_reset_that_writes_its_blocks_is_refused_by_name():
    module = _skeleton(RootResets)
    materialise.materialise(module, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"RootResets \(reset_parameters\) also writes model parameter blocks\.0\."):
        materialise.initialise_by_unit(module, seed=SEED, host=torch.device("cpu"))


def test_a_buffer_computed_from_a_parameter_is_not_built_unit_by_unit():
    with pytest.raises(ConfigError, match=r"model buffer scale is computed from a parameter"):
        materialise.check_initialisable(_skeleton(BufferFromWeight))


def test_the_unit_build_writes_every_parameter_of_a_sound_model():
    module = _skeleton(_Base)
    materialise.materialise(module, torch.device("cpu"))
    assert all(torch.isnan(p).all() for p in module.parameters())  # the sentinel, before
    materialise.initialise_by_unit(module, seed=SEED, host=torch.device("cpu"))
    assert not any(torch.isnan(p).any() for p in module.parameters())


@pytest.mark.parametrize("shards", [False, True])
def test_a_strategy_that_shards_wraps_the_skeleton_and_any_other_the_initialised_model(shards):
    """The order that gives every strategy the same weights: FSDP wraps meta parameters (then
    each rank draws its shards unit by unit), every other strategy an initialised model."""
    seen = {}

    def prepare(module):
        seen["prepare"] = all(p.is_meta for p in module.parameters())

    def wrap(module):
        seen["wrap"] = all(p.is_meta for p in module.parameters())
        return "wrapped"

    cfg = compose(["model=mlp", f"trainer.seed={SEED}"], "config")
    built = materialise.materialise_model(
        cfg.model, torch.device("cpu"), seed=SEED, shards=shards, offload=False, wrap=wrap, prepare=prepare
    )
    assert (built.rule, built.wrapped) == ("units", "wrapped")
    assert seen == {"prepare": True, "wrap": shards}
    if not shards:  # (sharded parameters need a strategy's DTensors to be materialised)
        assert not any(torch.isnan(p).any() for p in built.module.parameters())


def test_the_same_seed_draws_the_same_weights_and_leaves_the_same_random_state():
    cfg = compose(["model=mlp"], "config")
    made = []
    for _ in range(2):
        built = materialise.materialise_model(
            cfg.model, torch.device("cpu"), seed=SEED, shards=False, offload=False, wrap=lambda m: None
        )
        made.append(({n: p.detach().clone() for n, p in built.module.named_parameters()}, torch.rand(3)))
    (first, after_first), (again, after_again) = made
    assert all(torch.equal(first[n], again[n]) for n in first)
    torch.manual_seed(SEED)
    assert torch.equal(after_first, torch.rand(3)) and torch.equal(after_again, after_first)
