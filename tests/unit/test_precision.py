"""sharded_exp.precision: one parser for every spelling of a precision (option names, the
aliases, numbers, Lightning's, torch dtypes) and its clear refusal; the compute dtype and
bytes per value of each option, autocast, and which grad scaler each precision and sharding gets."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from sharded_exp.compose import NUMBER_NAMES, compose
from sharded_exp.errors import ConfigError
from sharded_exp.precision import (
    PRECISIONS,
    STATE_BYTES,
    Precision,
    alias_options,
    autocast,
    compute_bytes,
    compute_dtype,
    grad_scaler,
    step_precision,
)


def cfg(name: str, **kw):
    return OmegaConf.create({"name": name, "init_scale": 2.0**16, "growth_interval": 2000, "backoff_factor": 0.5, **kw})


@pytest.mark.parametrize(
    "name, dtype, nbytes", [("32", None, 4), ("16", torch.float16, 2), ("bf16", torch.bfloat16, 2)]
)
def test_each_precision_computes_in_its_dtype_and_bytes(name, dtype, nbytes):
    assert compute_dtype(name) is dtype
    assert compute_bytes(name) == nbytes
    assert STATE_BYTES == 4  # parameters, grads and optimizer state stay fp32


def test_a_number_names_its_precision_too():
    assert compute_dtype(16) is torch.float16 and compute_bytes(32) == 4


def test_an_unknown_precision_is_refused_naming_it_and_every_spelling():
    with pytest.raises(ConfigError, match=r"precision '8' is not one of: 32, fp32, 32-true, float32, 16, fp16, "):
        compute_dtype("8")
    with pytest.raises(
        ConfigError, match=r"precision torch\.float64 is not one of: .*bf16-mixed, bf16-true, bfloat16$"
    ):
        Precision.parse(torch.float64)
    assert PRECISIONS == ("32", "16", "bf16")


@pytest.mark.parametrize(
    "spellings, precision",
    [
        ((32, "32", "fp32", "32-true", "float32", torch.float32), Precision.fp32),
        ((16, "16", "fp16", "16-mixed", "16-true", "float16", torch.float16), Precision.fp16),
        (("bf16", "bf16-mixed", "bf16-true", "bfloat16", torch.bfloat16), Precision.bf16),
    ],
)
def test_every_spelling_parses_to_its_precision(spellings, precision):
    for spelling in (*spellings, precision):
        assert Precision.parse(spelling) is precision, spelling


def test_a_precision_names_the_option_a_run_records_and_lightnings_precision():
    assert [p.value for p in Precision] == ["32", "16", "bf16"]
    assert [p.lightning for p in Precision] == ["32-true", "16-mixed", "bf16-mixed"]
    assert compute_dtype("fp16") is torch.float16 and compute_dtype(torch.bfloat16) is torch.bfloat16


def test_a_config_answers_its_precision_as_a_member_that_reads_as_its_option_name():
    """Precision.of is how every module outside pre-flight's check reads a config's precision:
    composed or typed alike, and the member stands wherever the option's name did."""
    cfg = compose(["precision=fp16"])
    assert Precision.of(cfg) is Precision.fp16
    assert Precision.of(OmegaConf.create({"precision": {"name": "bf16"}})) is Precision.bf16
    member = Precision.fp16
    assert (str(member), f"{member}", f"{member:>3}") == ("16", "16", " 16")
    assert member == "16" and {"16": "found"}[member] == "found" and member in PRECISIONS
    with pytest.raises(ConfigError, match="'fp8'"):
        Precision.of(OmegaConf.create({"precision": {"name": "fp8"}}))


def test_the_config_groups_alias_options_are_the_precisions_names():
    """precision=fp16 composes as precision=16 (the option stored from Precision), and the
    command line's numbers become these names (compose.NUMBER_NAMES)."""
    assert alias_options() == {"fp32": "32", "fp16": "16"}
    assert NUMBER_NAMES["precision"] == {"32": "fp32", "16": "fp16"}
    for alias, option in alias_options().items():
        assert compose([f"precision={alias}"]).precision.name == option


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


def test_a_step_computes_at_autocasts_dtype_else_at_the_strategys_parameter_dtype():
    """MFU is held against the peak of the dtype the matmuls run in: FSDP gathering bf16
    parameters under precision=32 computes in bf16 (its policy casts the inputs too); autocast's
    dtype rules where the precision has one; a strategy without param_dtype stays at fp32."""
    job = lambda precision, **strategy: OmegaConf.create(  # noqa: E731
        {"precision": {"name": precision}, "strategy": {"name": "fsdp", "param_dtype": None, **strategy}}
    )
    assert step_precision(job("32", param_dtype="bfloat16")) == "bf16"
    assert step_precision(job("32", param_dtype="float16")) == "16"
    assert step_precision(job("32", param_dtype="float32")) == "32"
    assert step_precision(job("32")) == "32"
    assert step_precision(job("bf16", param_dtype="float32")) == "bf16"  # autocast computes in bf16
    assert step_precision(OmegaConf.create({"precision": {"name": "16"}, "strategy": {"name": "ddp"}})) == "16"
    assert step_precision(OmegaConf.create({"precision": {"name": "32"}, "strategy": {"name": "ddp"}})) == "32"
