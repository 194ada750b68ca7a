"""sharded_exp.precision: the compute dtype and bytes per value of each precision option,
autocast, and which grad scaler each precision and sharding gets."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from sharded_exp.precision import PRECISIONS, STATE_BYTES, autocast, compute_bytes, compute_dtype, grad_scaler


def cfg(name: str, **kw):
    return OmegaConf.create({"name": name, "init_scale": 2.0**16, "growth_interval": 2000, "backoff_factor": 0.5, **kw})


@pytest.mark.parametrize("name, dtype, nbytes", [("32", None, 4), ("16", torch.float16, 2), ("bf16", torch.bfloat16, 2)])
def test_each_precision_computes_in_its_dtype_and_bytes(name, dtype, nbytes):
    assert compute_dtype(name) is dtype
    assert compute_bytes(name) == nbytes
    assert STATE_BYTES == 4  # parameters, grads and optimizer state stay fp32


def test_a_number_names_its_precision_too():
    assert compute_dtype(16) is torch.float16 and compute_bytes(32) == 4


def test_an_unknown_precision_is_a_key_error():
    with pytest.raises(KeyError):
        compute_dtype("8")
    assert set(PRECISIONS) == {"32", "16", "bf16"}


def test_precision_32_runs_without_autocast():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(cfg("32"), "cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert (a @ b).dtype == torch.float32


def test_bf16_autocasts_matmuls_to_bfloat16():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(cfg("bf16"), "cpu"):
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32


@pytest.mark.parametrize("name, enabled", [("32", False), ("bf16", False), ("16", True)])
def test_only_precision_16_scales_the_loss(name, enabled):
    scaler = grad_scaler(cfg(name), "cpu", sharded_grads=False)
    assert type(scaler) is torch.amp.GradScaler and scaler.is_enabled() is enabled


def test_the_scaler_takes_the_configured_settings():
    scaler = grad_scaler(cfg("16", init_scale=128.0, growth_interval=7, backoff_factor=0.25), "cpu", False)
    assert scaler.get_scale() == 128.0
    assert scaler.get_growth_interval() == 7 and scaler.get_backoff_factor() == 0.25


def test_sharded_gradients_get_the_sharded_scaler_only_when_scaling():
    assert isinstance(grad_scaler(cfg("16"), "cpu", sharded_grads=True), ShardedGradScaler)
    for name in ("32", "bf16"):
        assert not isinstance(grad_scaler(cfg(name), "cpu", sharded_grads=True), ShardedGradScaler)
    assert not isinstance(grad_scaler(cfg("16"), "cpu", sharded_grads=False), ShardedGradScaler)
