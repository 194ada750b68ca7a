"""sharded_exp.measure.cuda_kernels: the cuBLAS workspace rule, the target device a step
runs as, and the emulation of CUDA's fused attention (its shapes, what it saves and the
FLOPs counted for it)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401 -- a dispatch mode imports it on first use; paid at collection
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sharded_exp.measure.cuda_kernels import (
    EARLIER_WORKSPACE_MIB,
    HOPPER_WORKSPACE_MIB,
    cublas_workspace_mib,
    cuda_kernels,
    forward_kernels,
    makes_kernel_outputs,
    target_device,
)


# ------------------------------------------------------------------ cuBLAS workspace
@pytest.fixture
def no_config(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def test_the_workspace_defaults_are_torchs_per_compute_capability(no_config):
    assert HOPPER_WORKSPACE_MIB == 32.0
    assert EARLIER_WORKSPACE_MIB == (4096 * 2 + 16 * 8) / 1024 == 8.125  # ":4096:2:16:8" in KiB x count
    assert cublas_workspace_mib((9, 0))[0] == 32.0
    assert cublas_workspace_mib((10, 0))[0] == 32.0
    mib, source = cublas_workspace_mib((8, 0))
    assert mib == 8.125 and source.endswith("compute capability 8.x")


def test_an_unknown_capability_assumes_hopper_and_says_so(no_config):
    mib, source = cublas_workspace_mib()
    assert mib == 32.0 and "9.0+ assumed" in source


@pytest.mark.parametrize("config, mib", [(":4096:8", 32.0), (":4096:2:16:8", 8.125), (":16:8", 0.125)])
def test_the_workspace_config_wins_over_the_capability(monkeypatch, config, mib):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_mib((8, 0)) == (mib, f"CUBLAS_WORKSPACE_CONFIG={config}")


def test_a_workspace_config_without_pairs_is_ignored(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "garbage")
    assert cublas_workspace_mib((8, 6))[0] == 8.125


# ---------------------------------------------------------------------- target device
def test_the_target_is_cuda_inside_the_emulation_only():
    cpu = torch.device("cpu")
    assert target_device(cpu) == "cpu" and forward_kernels() is None
    with cuda_kernels() as mode:
        assert target_device(cpu) == "cuda"
        assert forward_kernels() is mode
    assert target_device(cpu) == "cpu" and forward_kernels() is None


# ------------------------------------------------------------------- fused attention
B, H, T, D = 2, 3, 5, 4


def qkv(requires_grad: bool):
    return [torch.randn(B, H, T, D, requires_grad=requires_grad) for _ in range(3)]


def test_attention_forward_flops_are_two_matmuls_of_the_scores():
    q, k, v = qkv(False)
    with cuda_kernels() as mode:
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == (B, H, T, D)
    assert mode.flops == 2 * (2 * B * H * T * T * D)  # Q K^T, then P V


def test_attention_with_gradients_counts_its_backward_too():
    """Backward: the scores recomputed, dP and dV, dQ and dK: five more products."""
    q, k, v = qkv(True)
    with cuda_kernels() as mode:
        out = F.scaled_dot_product_attention(q, k, v)
    assert mode.flops == 7 * (2 * B * H * T * T * D)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_the_emulated_attention_saves_what_the_fused_kernel_keeps():
    """The output and a float32 log-sum-exp per query, never the T x T scores."""
    q, k, v = qkv(True)
    with cuda_kernels():
        out = F.scaled_dot_product_attention(q, k, v)
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    assert (B, H, T, T) not in saved and saved.count((B, H, T, D)) == 4  # q, k, v and the output
    lse = [t for t in out.grad_fn.saved_tensors if t.dim() == 3]
    assert len(lse) == 1 and lse[0].shape == (B, H, T) and lse[0].dtype == torch.float32


def test_other_functions_pass_through_the_emulation():
    x = torch.arange(4.0)
    with cuda_kernels() as mode:
        assert torch.equal(torch.add(x, 1), x + 1)
    assert mode.flops == 0


def test_kernel_outputs_are_flagged_only_while_the_fused_kernel_makes_them():
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.__name__, makes_kernel_outputs()))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(False)
    with cuda_kernels(), Spy():
        F.scaled_dot_product_attention(q, k, v)
        torch.add(q, 1)
    assert [flag for name, flag in seen if name.startswith("new_empty")] == [True, True]
    assert ("add.Tensor", False) in seen
    assert makes_kernel_outputs() is False
