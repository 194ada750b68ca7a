"""models/__init__.py: the units finder (which submodules are the repeated blocks: a model's
own hook, Hugging Face's ``_no_split_modules`` without nesting, else the longest ModuleList or
Sequential of like blocks), freezing by pattern, and build_model's registry lookup."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.errors import ConfigError
from sharded_exp.models import MODELS, build_model, freeze_parameters, units
from sharded_exp.models.gpt import GPT, GPTConfig
from sharded_exp.models.mlp import MLP, MLPConfig


class Block(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class Holder(Block):
    """A block holding a Sub: named beside it in _no_split_modules, the Sub inside is no unit."""

    def __init__(self):
        super().__init__()
        self.sub = Sub()


def test_a_models_own_hook_names_its_units_over_any_structure():
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(4, 2)

        def sharding_units(self):
            return (self.head,)

    model = Hooked()
    assert units(model) == [model.head]


def test_hugging_faces_no_split_modules_are_units_and_units_never_nest():
    class HF(nn.Module):
        _no_split_modules = ["Holder", "Sub"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Holder(), Holder()])
            self.extra = Sub()  # outside every Holder: a unit of its own
            self.longer = nn.ModuleList(Block() for _ in range(5))  # not used: the names win

    model = HF()
    assert units(model) == [model.layers[0], model.layers[1], model.extra]


def test_no_split_modules_naming_no_submodule_falls_back_to_the_structure():
    class HF(nn.Module):
        _no_split_modules = ["NotHere"]

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

    model = HF()
    assert units(model) == list(model.blocks)


def test_the_longest_list_of_blocks_is_the_units_the_first_among_equals():
    class Two(nn.Module):
        def __init__(self, a: int, b: int):
            super().__init__()
            self.first = nn.ModuleList(Block() for _ in range(a))
            self.second = nn.ModuleList(Block() for _ in range(b))

    longer_second = Two(2, 3)
    assert units(longer_second) == list(longer_second.second)
    equal = Two(3, 3)
    assert units(equal) == list(equal.first)


def test_a_sequential_of_like_blocks_with_parameters_is_a_list_of_units():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))  # mixed: no
            self.acts = nn.Sequential(nn.GELU(), nn.GELU(), nn.GELU(), nn.GELU())  # no parameters: no
            self.one = nn.Sequential(nn.Linear(4, 4))  # one child: no
            self.blocks = nn.Sequential(Block(), Block())

    model = Net()
    assert units(model) == list(model.blocks)


def test_a_model_without_repeated_blocks_has_no_units_and_is_never_its_own_unit():
    assert units(nn.Linear(3, 3)) == []
    assert units(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))) == []


def test_our_models_units_are_their_layers_and_blocks():
    mlp = MLP(MLPConfig(depth=3))
    assert units(mlp) == list(mlp.body)
    gpt = GPT(GPTConfig(d_model=8, n_heads=2, n_layers=3, seq_len=4, vocab_size=8))
    assert units(gpt) == list(gpt.blocks_)


# ------------------------------------------------------------------ freezing
def _named():
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.LayerNorm(2))


def test_freezing_sets_requires_grad_off_for_the_matching_names_only_and_returns_them_once():
    model = _named()
    frozen = freeze_parameters(model, ["0.*", "*.weight"])
    assert frozen == ["0.weight", "0.bias", "1.weight", "2.weight"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["1.bias", "2.bias"]


def test_a_pattern_matching_nothing_is_refused_naming_the_parameters():
    with pytest.raises(ConfigError, match=r"'encoder\.\*' matches no parameter.*0\.weight, 0\.bias, 1\.weight"):
        freeze_parameters(_named(), ["encoder.*"])


def test_a_long_parameter_list_is_cut_at_twelve_with_the_count():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(7)])  # 14 parameters
    with pytest.raises(ConfigError) as info:
        freeze_parameters(model, ["nope"])
    message = str(info.value)
    assert "5.bias, ... (14 in all)" in message and "6.weight" not in message


# ------------------------------------------------------------------ build_model
def test_build_model_builds_the_registered_model_of_the_configs_name_and_freezes_it():
    cfg = OmegaConf.structured(MLPConfig(in_features=3, hidden=5, depth=2, num_classes=2))
    model = build_model(cfg, freeze=["head.*"])
    assert isinstance(model, MLP) and model.head.weight.shape == (2, 5)
    assert not model.head.weight.requires_grad and model.body[0][0].weight.requires_grad
    assert MODELS.config_class("gpt") is GPTConfig and MODELS.config_class("mlp") is MLPConfig


def test_build_model_builds_a_target_config_by_its_target():
    model = build_model(OmegaConf.create({"name": "custom", "_target_": "torch.nn.Linear", "in_features": 3,
                                          "out_features": 2}))  # fmt: skip
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


def test_an_unknown_model_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        build_model(OmegaConf.create({"name": "nope"}))
