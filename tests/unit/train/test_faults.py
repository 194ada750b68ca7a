"""sharded_exp.train.faults: parsing SHARDED_EXP_FAULT, which rank and step act it out, the
kinds that can be acted out in-process (raise, oom on CPU, inf_grad, exit_in_save's check)."""

from __future__ import annotations

import pytest
import torch

from sharded_exp.train import faults
from sharded_exp.train.faults import Fault, Injector, parse
from tests.helpers.unit_train import PlainStrategy, TinyClassifier, batch

CPU = torch.device("cpu")


@pytest.fixture
def fault_env(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    def set_fault(text):
        monkeypatch.setenv(faults.ENV, text)

    return set_fault


def test_parse_reads_rank_step_and_kind_in_any_order():
    assert parse("rank=1,step=3,kind=raise") == Fault(rank=1, step=3, kind="raise")
    assert parse("kind=oom,step=0,rank=2") == Fault(rank=2, step=0, kind="oom")


@pytest.mark.parametrize("text", ["rank=1,step=3", "rank=x,step=3,kind=raise", "rank=1;step=3;kind=raise", ""])
def test_parse_refuses_a_malformed_fault_naming_the_form(text):
    with pytest.raises(ValueError, match="is not of the form rank=R,step=S,kind=K"):
        parse(text)


def test_parse_refuses_an_unknown_kind_listing_the_known_ones():
    with pytest.raises(ValueError, match="kind='explode' is not one of raise, exit, hang"):
        parse("rank=0,step=1,kind=explode")


def test_from_env_is_none_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.from_env() is None
    monkeypatch.setenv(faults.ENV, "   ")
    assert faults.from_env() is None


def test_from_env_acts_only_in_the_first_attempt(fault_env, monkeypatch):
    fault_env("rank=0,step=2,kind=raise")
    assert faults.from_env() == Fault(0, 2, "raise")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart runs clean
    assert faults.from_env() is None


def test_the_injector_keeps_only_its_own_ranks_fault(fault_env):
    fault_env("rank=1,step=2,kind=raise")
    assert Injector(0, CPU).fault is None
    assert Injector(1, CPU).fault == Fault(1, 2, "raise")


def test_the_injector_raises_at_the_start_of_its_step_only(fault_env):
    fault_env("rank=0,step=2,kind=raise")
    injector = Injector(0, CPU)
    injector.before_step(0, None)
    injector.before_step(1, None)
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at step 2"):
        injector.before_step(2, None)
    injector.before_step(3, None)  # past its step: nothing


def test_an_oom_fault_on_cpu_raises_torchs_out_of_memory_error(fault_env):
    fault_env("rank=0,step=0,kind=oom")
    with pytest.raises(torch.OutOfMemoryError, match="injected out-of-memory on rank 0 at step 0"):
        Injector(0, CPU).before_step(0, None)


def test_an_exit_in_save_fault_does_nothing_at_the_start_of_a_step(fault_env):
    fault_env("rank=0,step=1,kind=exit_in_save")
    Injector(0, CPU).before_step(1, None)  # the checkpoint writer acts it out


def test_in_save_exits_only_on_the_faults_rank_and_step(fault_env, monkeypatch):
    exits = []
    monkeypatch.setattr(faults.os, "_exit", lambda code: exits.append(code))
    fault_env("rank=0,step=4,kind=exit_in_save")
    faults.in_save(1, 4)
    faults.in_save(0, 3)
    assert exits == []
    faults.in_save(0, 4)
    assert exits == [3]
    fault_env("rank=0,step=4,kind=raise")
    faults.in_save(0, 4)
    assert exits == [3]


def test_an_inf_grad_fault_poisons_this_ranks_gradient_for_its_step_only(fault_env, gloo_group):
    fault_env("rank=0,step=1,kind=inf_grad")
    strategy = PlainStrategy(TinyClassifier())
    injector = Injector(0, CPU)
    first = strategy.local_shard()[0]

    def backward():
        strategy.zero_grad()
        strategy.model(**batch(0, 0, 0))["loss"].backward()
        return first.grad

    injector.before_step(0, strategy)
    assert torch.isfinite(backward()).all()
    injector.before_step(1, strategy)
    assert torch.isinf(backward()).all()
    injector.after_step()  # the hook is removed after its step
    assert torch.isfinite(backward()).all()
