"""The data tasks and the prefetcher, in-process (issue 23, item 15): batches are a pure
function of (step, micro, rank), made ahead only when that pays, and the Markov chain is
the chain its tables describe."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from sharded_exp.data import Task, build_task
from sharded_exp.data.markov import LEVELS
from sharded_exp.data.prefetch import Prefetcher


def markov(vocab: int = 50, seq_len: int = 200, batch: int = 8, name: str = "markov"):
    return build_task(
        OmegaConf.create({"name": name, "seed": 7, "branching": 3}),
        OmegaConf.create({"name": "gpt", "vocab_size": vocab, "seq_len": seq_len}),
        batch,
    )


def test_the_markov_chain_follows_its_successor_table():
    """Nearly every next token is one of the previous token's successors (1% restart
    uniformly), the branch frequencies follow the weights, and a batch is reproducible."""
    from sharded_exp.data import generator

    g = generator(7)
    successors = torch.randint(50, (50, 3), generator=g)
    weights = torch.rand(50, 3, generator=g) + 0.1
    task = markov()
    tokens = torch.cat([task(step, 0, 0)["input_ids"] for step in range(20)])
    targets = torch.cat([task(step, 0, 0)["targets"] for step in range(20)])
    assert torch.equal(task(3, 0, 0)["input_ids"], task(3, 0, 0)["input_ids"])
    assert not torch.equal(task(3, 0, 0)["input_ids"], task(3, 0, 1)["input_ids"])
    prev, nxt = tokens.reshape(-1), targets.reshape(-1)
    follows = (successors[prev] == nxt[:, None]).any(1).float().mean().item()
    assert 0.97 <= follows < 1.0  # restarts exist, and are rare
    # Branch frequencies of token 0's successors against its weights (probabilities in 1/LEVELS steps).
    counts = torch.stack([((prev == v)[:, None] & (successors[v] == nxt[:, None])).sum(0) for v in range(50)])
    share = counts.sum(0).float() / counts.sum()
    expected = (weights / weights.sum(1, keepdim=True)).mean(0)
    assert torch.allclose(share, expected, atol=0.03 + 1 / LEVELS)


def test_the_chain_at_gpt2_small_shape_is_vectorised(monkeypatch):
    """8 x 1025 tokens of a 50257-token vocabulary: a loop of draws per token took 130 ms. Every
    random number is drawn up front in whole tensors (a handful of draws per batch, not one per
    token): counted, not timed (a loaded machine cannot break it; the time is
    benchmarks/features/data_time.py's figure)."""
    task = markov(vocab=50257, seq_len=1024)
    task(0, 0, 0)
    draws = []
    for name in ("randint", "rand", "multinomial"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: draws.append(_name) or _real(*a, **k))
    batch = task(1, 0, 0)
    assert batch["input_ids"].shape == (8, 1024) and batch["input_ids"].max() < 50257
    assert 0 < len(draws) <= 8, draws  # per batch, not per token (8 x 1024 draws before)


def slow_task(seconds: float) -> Task:
    def batch(step, micro, rank):
        time.sleep(seconds)
        return {"x": torch.full((2,), float(step * 10 + micro + 100 * rank))}

    return Task(batch, metric="accuracy")


@pytest.mark.parametrize("seconds, ahead", [(0.0, False), (0.03, True)])
def test_batches_are_made_ahead_only_when_making_them_costs_more_than_a_gil_switch(seconds, ahead):
    # The decision against a switch interval far from either case: a loaded machine (CI shares
    # it) can take more than Python's 5 ms to make even a trivial batch.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.015)
    try:
        _made_ahead(seconds, ahead)
    finally:
        sys.setswitchinterval(switch)


def _made_ahead(seconds: float, ahead: bool) -> None:
    task = slow_task(seconds)
    fetch = Prefetcher(task, rank=1, grad_accum=2, device=torch.device("cpu"), end=6)
    waits = []
    for step in range(6):
        t0 = time.perf_counter()
        batches = fetch.get(step)
        waits.append(time.perf_counter() - t0)
        assert [b["x"][0].item() for b in batches] == [step * 10 + 100, step * 10 + 101]
        time.sleep(0.1)  # the step: long enough for the next batches to be made meanwhile
    fetch.close()
    assert fetch.ahead is ahead and fetch.make_s is not None
    if ahead:  # steps after the second wait less than making their batches takes (made meanwhile)
        assert max(waits[3:]) < 2 * seconds <= min(waits[:2])


def test_a_step_the_loop_jumps_to_is_made_in_the_loop():
    fetch = Prefetcher(slow_task(0.03), rank=0, grad_accum=1, device=torch.device("cpu"), end=10)
    for step in (0, 1, 2):
        fetch.get(step)
    assert fetch.get(7)[0]["x"][0].item() == 70  # not step 3's prefetched batch
    fetch.close()


def test_no_batch_is_made_in_another_thread_beside_a_tracked_step():
    """The CPU tracker's dispatch mode belongs to the training thread: batches of the steps
    that run beside a tracked one are made in the loop, later ones ahead."""
    import threading

    makers = {}

    def batch(step, micro, rank):
        time.sleep(0.03)  # dearer than a GIL switch: the prefetcher goes ahead when allowed
        makers[step] = threading.current_thread() is threading.main_thread()
        return {"x": torch.full((2,), float(step))}

    fetch = Prefetcher(Task(batch, metric="accuracy"), rank=0, grad_accum=1, device=torch.device("cpu"),
                       end=6, quiet_until=3)  # fmt: skip
    for step in range(6):
        assert fetch.get(step)[0]["x"][0].item() == step
    fetch.close()
    # made beside steps 0..2 (tracked): in the loop; step 4's is made beside step 3, ahead
    assert [makers[s] for s in range(4)] == [True] * 4 and makers[4] is False and makers[5] is False
