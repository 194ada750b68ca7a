"""sharded_exp.checkpoint.state: the optimizer and model state keyed by parameter name, the
hyperparameter changes a resume records, installing a name-keyed state into an optimizer whose
parameters are ordered differently, and restore() of a consolidated checkpoint (RNG included)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sharded_exp.checkpoint.state import (
    _plain,
    gather_model_state,
    gather_optimizer_state,
    hyperparameter_changes,
    load_model_state,
    load_optimizer_state,
    local_optimizer_state,
    named_param_groups,
    restore,
)
from sharded_exp.checkpoint.storage import CheckpointError

NAMES = {"0.weight", "0.bias", "2.weight"}


def _by_name(strategy):
    return dict(strategy.module.named_parameters())


# ------------------------------------------------------------------- by parameter name
def test_named_param_groups_replace_tensors_by_names_and_keep_hyperparameters(make_strategy):
    strategy = make_strategy(lr=0.03, weight_decay=0.1)
    groups = named_param_groups(strategy)
    assert [g["params"] for g in groups] == [["0.weight", "2.weight"], ["0.bias"]]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.03, 0.1), (0.03, 0.0)]


def test_local_optimizer_state_is_keyed_by_parameter_name(make_strategy):
    strategy = make_strategy()
    local = local_optimizer_state(strategy)
    params = _by_name(strategy)
    assert set(local) == NAMES
    for name, state in local.items():
        assert state["exp_avg"] is strategy.optimizer.state[params[name]]["exp_avg"]  # no copy
        assert state["exp_avg"].shape == params[name].shape


def test_local_optimizer_state_leaves_out_parameters_without_state(make_strategy):
    assert local_optimizer_state(make_strategy(steps=0)) == {}


def test_gather_model_state_is_a_detached_copy_of_the_state_dict(gloo_group, make_strategy):
    strategy = make_strategy()
    full = gather_model_state(strategy)
    assert set(full) == NAMES
    before = full["0.weight"].clone()
    with torch.no_grad():
        strategy.module[0].weight.add_(1.0)
    assert torch.equal(full["0.weight"], before)  # a copy, not a view of the parameter


def test_gather_optimizer_state_names_state_and_groups(gloo_group, make_strategy):
    strategy = make_strategy(steps=2)
    gathered = gather_optimizer_state(strategy)
    params = _by_name(strategy)
    assert set(gathered["state"]) == NAMES
    assert torch.equal(
        gathered["state"]["0.bias"]["exp_avg_sq"], strategy.optimizer.state[params["0.bias"]]["exp_avg_sq"]
    )
    assert float(gathered["state"]["2.weight"]["step"]) == 2.0
    assert gathered["param_groups"] == named_param_groups(strategy)


# ----------------------------------------------------------------- hyperparameters
def test_plain_turns_tensors_and_tuples_into_plain_values():
    assert _plain(torch.tensor(0.5)) == 0.5
    assert _plain((0.9, torch.tensor(0.99))) == [0.9, pytest.approx(0.99)]
    assert _plain(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
    assert _plain("x") == "x"


def test_hyperparameter_changes_record_each_differing_key_per_group():
    now = [{"lr": 0.1, "betas": (0.9, 0.999), "params": [1]}, {"lr": 0.2, "weight_decay": 0.0, "params": [2]}]
    saved = [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["a"]}, {"lr": 0.3, "weight_decay": 0.0, "params": ["b"]}]
    assert hyperparameter_changes(now, saved) == [
        {"group": 0, "key": "betas", "checkpoint": [0.9, 0.95], "config": [0.9, 0.999]},
        {"group": 1, "key": "lr", "checkpoint": 0.3, "config": 0.2},
    ]


def test_hyperparameter_changes_ignore_the_implementation_flags_and_equal_values_of_other_types():
    now = [{"lr": torch.tensor(0.5), "betas": (0.9, 0.999), "foreach": True, "fused": None, "capturable": True,
            "differentiable": True, "params": [0]}]  # fmt: skip
    saved = [{"lr": 0.5, "betas": [0.9, 0.999], "foreach": None, "fused": False, "capturable": False,
              "differentiable": False, "params": ["w"]}]  # fmt: skip
    assert hyperparameter_changes(now, saved) == []


def test_hyperparameter_changes_ignore_keys_only_one_side_has():
    assert hyperparameter_changes([{"lr": 0.1, "momentum": 0.9}], [{"lr": 0.1, "amsgrad": True}]) == []


# ------------------------------------------------------------- installing the state
def test_loaded_optimizer_state_follows_names_not_positions(make_strategy):
    source = make_strategy(seed=1, steps=3)
    saved = {"state": local_optimizer_state(source), "param_groups": named_param_groups(source)}
    target = make_strategy(seed=2, steps=0)
    # the same parameters in another order within the weight group
    w0, w2 = target.module[0].weight, target.module[2].weight
    target.optimizer.param_groups[0]["params"] = [w2, w0]
    load_optimizer_state(target, saved)
    assert torch.equal(target.optimizer.state[w0]["exp_avg"], saved["state"]["0.weight"]["exp_avg"])
    assert torch.equal(target.optimizer.state[w2]["exp_avg"], saved["state"]["2.weight"]["exp_avg"])
    assert float(target.optimizer.state[target.module[0].bias]["step"]) == 3.0


def test_loaded_optimizer_keeps_the_configured_hyperparameters_and_reports_the_change(make_strategy):
    source = make_strategy(lr=0.01)
    saved = {"state": local_optimizer_state(source), "param_groups": named_param_groups(source)}
    target = make_strategy(lr=0.05, steps=0)
    changes = load_optimizer_state(target, saved)
    assert [g["lr"] for g in target.optimizer.param_groups] == [0.05, 0.05]
    assert changes == [
        {"group": 0, "key": "lr", "checkpoint": 0.01, "config": 0.05},
        {"group": 1, "key": "lr", "checkpoint": 0.01, "config": 0.05},
    ]


def test_a_state_with_another_number_of_groups_is_refused(make_strategy):
    source = make_strategy()
    saved = {"state": local_optimizer_state(source), "param_groups": named_param_groups(source)[:1]}
    with pytest.raises(CheckpointError, match="checkpoint has 1 optimizer parameter groups, this optimizer 2"):
        load_optimizer_state(make_strategy(steps=0), saved)


def test_load_model_state_installs_the_saved_tensors(make_strategy):
    saved = {k: v.clone() for k, v in make_strategy(seed=1).module.state_dict().items()}
    target = make_strategy(seed=2, steps=0)
    load_model_state(target, saved)
    for k, v in target.module.state_dict().items():
        assert torch.equal(v, saved[k])


# ---------------------------------------------------------------------------- restore
def _write_consolidated(path, strategy, rng):
    os.makedirs(path)
    torch.save(gather_model_state(strategy), os.path.join(path, "model.pt"))
    torch.save(gather_optimizer_state(strategy), os.path.join(path, "optim.pt"))
    torch.save({"scaler": {}, "rng": rng, "param_groups": named_param_groups(strategy)}, os.path.join(path, "train.pt"))
    shapes = {k: list(v.shape) for k, v in strategy.module.state_dict().items()}
    meta = {"format": 1, "checkpoint_format": "consolidated", "step": 3, "strategy": "ddp", "world_size": len(rng),
            "optimizer": "adam", "model": {"name": "tiny"}, "param_shapes": shapes}  # fmt: skip
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_restore_brings_back_model_optimizer_and_the_rng_at_the_same_world_size(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1, steps=2)
    target = make_strategy(seed=2, steps=0, lr=0.02)
    torch.manual_seed(1234)
    saved_rng = torch.get_rng_state()
    expected_draw = torch.rand(4)
    _write_consolidated(tmp_path / "c", source, rng=[{"cpu": saved_rng}])

    torch.manual_seed(999)
    meta = restore(target, str(tmp_path / "c"), torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected_draw)  # the RNG continues where the checkpoint left it
    assert meta["step"] == 3
    assert {c["key"] for c in meta["resume_changes"]} == {"lr"}
    for k, v in source.module.state_dict().items():
        assert torch.equal(target.module.state_dict()[k], v)
    params = _by_name(target)
    for name, state in local_optimizer_state(source).items():
        assert torch.equal(target.optimizer.state[params[name]]["exp_avg_sq"], state["exp_avg_sq"])


def test_restore_leaves_the_rng_alone_at_another_world_size(gloo_group, make_strategy, tmp_path):
    source = make_strategy(seed=1)
    other = torch.Generator().manual_seed(5).get_state()
    _write_consolidated(tmp_path / "c", source, rng=[{"cpu": other}, {"cpu": other}])  # written by 2 ranks
    target = make_strategy(seed=2, steps=0)
    torch.manual_seed(77)
    expected = torch.rand(3)
    torch.manual_seed(77)
    restore(target, str(tmp_path / "c"), torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)
