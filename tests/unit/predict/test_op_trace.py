"""The op trace: each aten op's FLOPs, bytes, dtype, phase and unit, recorded as plain numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from sharded_exp.predict.op_trace import Trace, tracing


class Two(nn.Module):
    def __init__(self, recompute: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2)])
        self.recompute = recompute

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return x.sum()


def step(model, trace=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tracing(trace, list(model.blocks)):
        model(torch.ones(4, 8)).backward()
        opt.step()


def test_the_trace_counts_the_flops_torchs_counter_counts():
    model, trace = Two(), Trace()
    step(model, trace)
    with FlopCounterMode(display=False) as counter:
        model(torch.ones(4, 8)).backward()
    assert sum(r["flops"] for r in trace.records) == counter.get_total_flops() > 0


def test_the_cpus_fused_attention_counts_the_flops_of_its_cuda_kernels():
    """torch 2.13 has no FLOP formula for the CPU's flash attention: ours counts what
    torch counts for the CUDA flash kernel (forward 4 b h s^2 d, backward 2.5 times that)."""
    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    forward = 4 * 2 * 3 * 16 * 16 * 8
    assert counter.get_total_flops() == forward + 2.5 * forward


@pytest.mark.parametrize("causal", [True, False])
def test_the_cpus_fused_attention_is_recorded_causal_as_it_was_called(causal):
    """The this profile's attention curve is of causal calls (a call that is not causal takes
    twice its time): the CPU's kernel and its backward carry is_causal as called. They were
    recorded with none, so a causal call was priced as a call that is not."""
    q, trace = torch.randn(1, 2, 16, 8, requires_grad=True), Trace()
    with tracing(trace, []):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal).sum().backward()
    attention = [r for r in trace.records if "flash_attention" in r["op"]]
    assert len(attention) == 2 and all(r["causal"] is causal for r in attention)


def test_ops_are_phased_and_the_forwards_attributed_to_their_units():
    model, trace = Two(), Trace()
    step(model, trace)
    records = trace.phased()
    phases = [r["phase"] for r in records]
    assert phases[0] == "forward" and "backward" in phases and phases[-1] == "optimizer"
    assert phases.index("optimizer") > max(i for i, p in enumerate(phases) if p == "backward")
    units = {r["unit"] for r in records if r["phase"] == "forward" and r["flops"]}
    assert units == {0, 1} and trace.units == 2
    matmul = next(r for r in records if r["flops"])
    assert (
        matmul["dtype"] == "fp32" and matmul["input_bytes"] > 0 and matmul["output_bytes"] == 4 * 8 * 4
    )  # float32 4 x 8


def test_a_linear_layers_matmuls_record_which_operand_is_read_transposed():
    """Forward x @ W^T (addmm with W.t(): nt); backward the input's gradient g @ W (nn) and
    the weight's g^T @ x (tn); no other op has a layout."""
    layer, trace = nn.Linear(8, 4), Trace()
    with tracing(trace, []):
        layer(torch.ones(16, 8, requires_grad=True)).square().sum().backward()
    matmuls = [(r["op"], r["layout"], r["backward"]) for r in trace.records if "layout" in r]
    assert sorted(matmuls) == [
        ("aten.addmm.default", "nt", False), ("aten.mm.default", "nn", True), ("aten.mm.default", "tn", True)
    ]  # fmt: skip
    assert all("layout" not in r for r in trace.records if "mm" not in r["op"])


def test_recomputation_under_checkpointing_is_counted_in_the_backward():
    plain, recomputed = Trace(), Trace()
    step(Two(), plain)
    step(Two(recompute=True), recomputed)
    flops = lambda t, phase: sum(r["flops"] for r in t.phased() if r["phase"] == phase)  # noqa: E731
    assert flops(recomputed, "forward") == flops(plain, "forward")
    # each block's first Linear (4 x 8 x 8 multiply-adds) runs again to remake the tanh's output
    # the second one saves (torch stops recomputing once every saved tensor is remade)
    assert flops(recomputed, "backward") == flops(plain, "backward") + 2 * (2 * 4 * 8 * 8)
    assert all(r["unit"] is None for r in recomputed.phased() if r["phase"] != "forward")


def test_no_trace_records_nothing_and_leaves_no_hook():
    model = Two()
    step(model, None)
    assert not model.blocks[0]._forward_pre_hooks and not model.blocks[0]._forward_hooks


class Attend(nn.Module):
    """One unit: q, k and v from one linear, then fused attention (causal or not)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.qkv, self.causal = nn.Linear(8, 24), causal

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _attention_records(recompute: bool | str, causal: bool):
    from sharded_exp.measure.cuda_kernels import cuda_kernels
    from sharded_exp.train.levers import _checkpointed

    unit, trace = Attend(causal), Trace()
    with cuda_kernels() as kernels, tracing(trace, [unit], kernels):
        x = torch.ones(2, 5, 8, requires_grad=True)
        mode = recompute if isinstance(recompute, str) else "full"
        out = _checkpointed(unit, mode)(x) if recompute else unit(x)  # as the ac lever runs it
        out.sum().backward()
    return [(r["op"], r["phase"], r["causal"]) for r in trace.phased() if r["op"].startswith("attention")]


def test_a_fused_attention_call_is_recorded_with_its_mask_and_its_backward_once():
    """Checkpointing runs the forward again in the backward: that recomputation is counted,
    the kernel's backward (which runs once) is not recorded a second time."""
    assert _attention_records(recompute=False, causal=True) == [
        ("attention.forward", "forward", True), ("attention.backward", "backward", True)]  # fmt: skip
    assert _attention_records(recompute=True, causal=False) == [
        ("attention.forward", "forward", False), ("attention.forward", "backward", False),
        ("attention.backward", "backward", False)]  # fmt: skip


@pytest.mark.parametrize("mode", ["selective", "selective_op"])
def test_selective_checkpointing_keeps_attention_so_its_recomputation_runs_no_kernel(mode):
    """Both selective policies keep CUDA's attention outputs: the recomputed forward takes them
    from the forward, so no second attention forward is timed (a full recomputation runs one)."""
    assert _attention_records(recompute=mode, causal=True) == [
        ("attention.forward", "forward", True), ("attention.backward", "backward", True)]  # fmt: skip


def test_new_storages_of_at_least_128_kib_are_recorded_with_the_next_timed_op():
    """What a CPU step maps anew: an op's new outputs (not a view's, not an in-place op's), a
    buffer ``empty`` makes among them."""
    trace, x = Trace(), torch.ones(256, 256)  # 256 KiB
    with tracing(trace, []):
        y = x @ x  # new: 256 KiB
        y.view(-1)  # a view: nothing new (and not timed)
        y.mul_(2)  # in place: nothing new
        buffer = torch.empty(512, 256)  # 512 KiB
        small = torch.ones(8, 8) + 1  # new but below 128 KiB
        buffer.add_(1)
    fresh = {r["op"]: r["fresh_bytes"] for r in trace.records}
    assert fresh["aten.mm.default"] == (256 * 1024,)
    assert fresh["aten.mul_.Tensor"] == ()
    assert fresh["aten.empty.memory_format"] == (512 * 1024,)
    assert fresh["aten.add.Tensor"] == () and small.numel() == 64
    assert fresh["aten.add_.Tensor"] == ()
