"""sharded_exp.optim: the two parameter groups (2-D weights decay, biases and norms don't,
at lr * no_decay_lr_scale), the optimizer's defaults per kind, and the foreach choice."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from sharded_exp.optim import OPTIMIZERS, OptimizerSpec, optimizer_spec, param_groups


def cfg(name="adam", **kw):
    base = {"name": name, "lr": 0.01, "weight_decay": 0.1, "no_decay_lr_scale": 0.5, "betas": [0.8, 0.9],
            "eps": 1e-6, "momentum": 0.7, "foreach": None}  # fmt: skip
    return OmegaConf.create({**base, **kw})


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.LayerNorm(3))


def ids(params):
    return {id(p) for p in params}


def test_matrices_decay_and_vectors_do_not():
    m = model()
    decay, no_decay = param_groups(cfg(), m)
    assert ids(decay["params"]) == {id(m[0].weight), id(m[1].weight)}
    assert ids(no_decay["params"]) == {id(m[1].bias), id(m[2].weight), id(m[2].bias)}
    assert decay["weight_decay"] == 0.1 and "lr" not in decay  # the optimizer's lr
    assert no_decay["weight_decay"] == 0.0 and no_decay["lr"] == pytest.approx(0.01 * 0.5)


def test_frozen_parameters_are_in_no_group_and_an_empty_group_is_dropped():
    m = model()
    for p in m.parameters():
        p.requires_grad_(p.dim() >= 2)
    groups = param_groups(cfg(), m)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    m[0].weight.requires_grad_(False)
    assert ids(param_groups(cfg(), m)[0]["params"]) == {id(m[1].weight)}


def test_adam_takes_betas_and_eps_and_sgd_takes_momentum():
    spec = optimizer_spec(cfg("adamw"), model())
    assert spec.cls is torch.optim.AdamW
    assert spec.defaults == {"lr": 0.01, "foreach": False, "betas": (0.8, 0.9), "eps": 1e-6}
    spec = optimizer_spec(cfg("sgd"), model())
    assert spec.cls is torch.optim.SGD
    assert spec.defaults == {"lr": 0.01, "foreach": False, "momentum": 0.7}
    assert OPTIMIZERS["adam"] is torch.optim.Adam


def test_foreach_follows_the_device_unless_set():
    m = model()
    assert optimizer_spec(cfg(), m).defaults["foreach"] is False  # CPU parameters: per tensor
    assert optimizer_spec(cfg(), m, torch.device("cuda")).defaults["foreach"] is True
    assert optimizer_spec(cfg(foreach=True), m).defaults["foreach"] is True
    assert optimizer_spec(cfg(foreach=False), m, torch.device("cuda")).defaults["foreach"] is False


def test_a_spec_regrouped_onto_the_host_steps_as_torch_does_there():
    """CPU offload (strategies/fsdp.py): a GPU run's spec regrouped over host parameters steps
    per tensor, torch's choice for CPU tensors, not CUDA's foreach (group-sized temporaries in
    host memory); optimizer.foreach set wins there too."""
    gpu = optimizer_spec(cfg(), model(), torch.device("cuda"))
    assert gpu.defaults["foreach"] is True and gpu.regroup(model()).defaults["foreach"] is True
    host = gpu.regroup(model(), torch.device("cpu"))
    assert host.defaults["foreach"] is False and host.device == torch.device("cpu")
    asked = optimizer_spec(cfg(foreach=True), model(), torch.device("cuda"))
    assert asked.regroup(model(), torch.device("cpu")).defaults["foreach"] is True


def test_the_device_is_the_parameters_own_or_cpu_without_any():
    assert optimizer_spec(cfg(), model()).device == torch.device("cpu")
    assert optimizer_spec(cfg(), nn.ReLU()).device == torch.device("cpu")
    assert optimizer_spec(cfg(), model(), torch.device("meta")).device == torch.device("meta")


def test_build_makes_the_optimizer_with_both_groups():
    m = model()
    opt = optimizer_spec(cfg("adam"), m).build()
    assert isinstance(opt, torch.optim.Adam) and len(opt.param_groups) == 2
    assert [g["lr"] for g in opt.param_groups] == [0.01, pytest.approx(0.005)]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_regroup_takes_the_modules_current_parameters():
    m = model()
    spec = optimizer_spec(cfg(), m)
    m[1].weight = nn.Parameter(torch.zeros(3, 4))  # as FSDP replaces them
    again = spec.regroup(m)
    assert isinstance(again, OptimizerSpec) and id(m[1].weight) in ids(again.param_groups[0]["params"])
    assert again.defaults == spec.defaults
