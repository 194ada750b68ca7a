"""sharded_exp.train.levers: which units activation checkpointing wraps (every N-th, none),
the selective policy's choice of what to keep, running checkpointed units plainly, and
compile's wrapping of each unit's forward (nothing compiled here: torch.compile is lazy)."""

from __future__ import annotations

import types

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from sharded_exp.config import ActivationCheckpointing
from sharded_exp.train import levers

aten = torch.ops.aten


class Stack(nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.head = nn.Linear(4, 2)
        self.config = types.SimpleNamespace(use_cache=True)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def wrapped(module):
    return [i for i, b in enumerate(module.blocks) if "forward" in vars(b)]  # an instance forward: wrapped


def test_full_checkpointing_wraps_every_unit_and_keeps_the_module_tree():
    m = Stack()
    names = [n for n, _ in m.named_parameters()]
    chosen = levers.checkpointed_units(m, ActivationCheckpointing.full)
    assert chosen == list(m.blocks)
    assert wrapped(m) == [0, 1, 2, 3, 4]
    assert [n for n, _ in m.named_parameters()] == names


def test_ac_every_wraps_units_0_n_2n():
    m = Stack(n=5)
    levers.checkpointed_units(m, "selective", every=2)
    assert wrapped(m) == [0, 2, 4]


def test_no_checkpointing_wraps_nothing_and_leaves_the_cache_alone():
    m = Stack()
    assert levers.checkpointed_units(m, "none") == []
    assert wrapped(m) == [] and m.config.use_cache is True


def test_checkpointing_turns_a_key_value_cache_off():
    m = Stack()
    levers.checkpointed_units(m, "full")
    assert m.config.use_cache is False


def test_checkpointed_units_compute_the_same_output_and_gradients():
    torch.manual_seed(0)
    plain = Stack()
    ac = Stack()
    ac.load_state_dict(plain.state_dict())
    levers.checkpointed_units(ac, "full")
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    ac(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_the_selective_policy_keeps_matmuls_and_recomputes_the_rest():
    assert levers._keep_matmuls(None, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert levers._keep_matmuls(None, aten.addmm.default) is CheckpointPolicy.MUST_SAVE
    assert levers._keep_matmuls(None, aten.tanh.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert levers._keep_matmuls(None, aten.relu.default) is CheckpointPolicy.PREFER_RECOMPUTE


def test_torchtitans_op_policy_recomputes_every_second_matmul_counting_forward_and_recompute_apart():
    policy = levers.torchtitan_op_policy()
    forward, recompute = types.SimpleNamespace(is_recompute=False), types.SimpleNamespace(is_recompute=True)
    ops = [aten.mm.default, aten.tanh.default, aten.mm.default, aten.addmm.default, aten.mm.default]
    keep, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(forward, op) for op in ops] == [keep, again, again, keep, again]  # addmm counts as a matmul
    assert [policy(recompute, op) for op in ops] == [keep, again, again, keep, again]  # the same choice again
    assert levers.torchtitan_op_policy()(forward, aten.mm.default) is keep  # a new call counts afresh


def test_torchtitans_op_policy_computes_the_same_gradients():
    torch.manual_seed(0)
    plain, ac = Stack(), Stack()
    ac.load_state_dict(plain.state_dict())
    levers.checkpointed_units(ac, ActivationCheckpointing.selective_op)
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    ac(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_without_checkpointing_a_wrapped_unit_runs_plainly_and_the_switch_is_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(levers, "checkpoint", lambda fn, *a, **kw: calls.append("checkpoint") or fn(*a))
    m = Stack(n=1)
    levers.checkpointed_units(m, "full")
    x = torch.randn(2, 4)
    with levers.without_checkpointing():
        m(x)
    assert calls == []
    m(x)
    assert calls == ["checkpoint"]


def test_compile_units_wraps_each_units_forward_with_the_mode_spelt_with_dashes(monkeypatch):
    seen = []
    monkeypatch.setattr(levers.torch, "compile", lambda fn, mode=None: seen.append(mode) or fn)
    m = Stack(n=3)
    assert levers.compile_units(m, "max_autotune") == list(m.blocks)
    assert seen == ["max-autotune"] * 3
    seen.clear()
    levers.compile_units(Stack(n=1), "default")
    assert seen == [None]


def test_apply_levers_checkpoints_first_and_compiles_only_when_asked(monkeypatch):
    order = []
    monkeypatch.setattr(levers, "checkpointed_units", lambda m, mode, every: order.append(("ac", str(mode), every)))
    monkeypatch.setattr(levers, "compile_units", lambda m, mode: order.append(("compile", mode)))
    cfg = OmegaConf.create({"activation_checkpointing": "full", "ac_every": 2, "compile": True,
                            "compile_mode": "default"})  # fmt: skip
    levers.apply_levers(Stack(), cfg)
    assert order == [("ac", "full", 2), ("compile", "default")]
    order.clear()
    levers.apply_levers(Stack(), cfg, compile=False)
    assert order == [("ac", "full", 2)]
    order.clear()
    levers.apply_levers(Stack(), OmegaConf.create({**cfg, "compile": False}))
    assert order == [("ac", "full", 2)]
