"""sharded_exp.train.liveness: the stop flag set by a signal, the ranks' agreement on the
step to stop at (world-size-1 gloo), and the words for a collective that timed out."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from sharded_exp.train import liveness


@pytest.fixture
def no_signal():
    liveness._requested.clear()
    yield
    liveness._requested.clear()


class Clock:
    """time.monotonic, advanced by hand."""

    def __init__(self, step_s):
        self.now, self.step_s = 0.0, step_s

    def monotonic(self):
        value = self.now
        self.now += self.step_s
        return value


def test_a_signal_only_records_a_stop_request_first_one_first(no_signal):
    assert liveness.requested_signal() is None
    liveness._on_signal(signal.SIGTERM, None)
    liveness._on_signal(signal.SIGINT, None)
    assert liveness.requested_signal() == signal.SIGTERM


def test_stop_agreement_checks_at_the_first_step_and_stops_at_the_check_after_a_signal(gloo_group, no_signal,
                                                                                         monkeypatch):  # fmt: skip
    monkeypatch.setattr(liveness, "time", Clock(step_s=0.0))
    stopper = liveness.StopAgreement()
    assert stopper.should_stop(0) is False  # first check: nothing in flight
    assert stopper._next_check == 1  # the first interval is one step
    liveness._on_signal(signal.SIGTERM, None)
    assert stopper.should_stop(1) is False  # the flag goes out with this check
    assert stopper.should_stop(2) is True  # ... and is read at the next one
    assert stopper.signum == signal.SIGTERM
    stopper.finish()


def test_stop_agreement_spaces_its_checks_about_a_period_apart(gloo_group, no_signal, monkeypatch):
    clock = Clock(step_s=0.0)
    monkeypatch.setattr(liveness, "time", clock)
    stopper = liveness.StopAgreement()
    stopper.should_stop(0)  # t = 0
    clock.now = 0.5  # one step took 0.5 s: a period is 2 steps
    stopper.should_stop(1)  # proposes 2, applies the interval agreed at step 0 (1)
    assert stopper._next_check == 2
    clock.now = 1.0
    stopper.should_stop(2)  # the agreed interval is now the proposal made at step 1
    assert stopper._next_check == 4
    assert stopper.should_stop(3) is False and stopper._next_check == 4  # between checks: no collective
    stopper.finish()
    assert stopper._work is None


def test_stop_agreement_proposes_at_most_10000_steps_between_checks(gloo_group, no_signal, monkeypatch):
    clock = Clock(step_s=0.0)
    monkeypatch.setattr(liveness, "time", clock)
    stopper = liveness.StopAgreement()
    stopper.should_stop(0)
    clock.now = 1e-9  # an implausibly fast step
    stopper.should_stop(1)
    stopper._work.wait()
    assert -stopper._buf[1].item() == 10_000
    stopper.finish()


@pytest.mark.parametrize(
    "message, expected",
    [
        ("[Gloo] Timed out waiting 60000ms for recv operation", True),
        ("Watchdog caught collective operation timeout", True),
        ("NCCL communicator was aborted on rank 1", True),
        ("CUDA out of memory", False),
        ("Connection reset by peer", False),
    ],
)
def test_is_timeout_recognises_a_collectives_timeout(message, expected):
    assert liveness.is_timeout(RuntimeError(message)) is expected


def test_collective_error_reads_the_backends_error_unless_it_is_success():
    class Code:
        def __init__(self, name):
            self.name = name

    class Backend:
        def __init__(self, name):
            self.get_error = lambda: Code(name)

    assert liveness.collective_error(object()) is None  # gloo: no get_error
    assert liveness.collective_error(Backend("SUCCESS")) is None
    assert liveness.collective_error(Backend("TIMEOUT")) == "TIMEOUT"


def test_raise_if_aborted_is_a_no_op_on_cpu():
    liveness.raise_if_aborted(torch.device("cpu"))


def test_describe_timeout_names_the_ranks_that_never_reported(gloo_group, monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(liveness.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(liveness, "REPORT_WINDOW_S", 0.0)  # the peers reported before: no wait
    monkeypatch.setattr(liveness, "current_step", 7)
    store.set("sharded_exp/timed_out/2", "7")
    text = liveness.describe_timeout(RuntimeError("Timed out"), 60.0)
    assert text == ("collective timed out after 60 s (trainer.timeout_s) in step 7: rank 1 did not arrive "
                    "(ranks that were waiting: rank 0: step 7, rank 2: step 7)")  # fmt: skip


def test_describe_timeout_when_every_rank_waited_blames_mismatched_collectives(gloo_group, monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(liveness.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(liveness, "current_step", 4)
    store.set("sharded_exp/timed_out/1", "5")
    text = liveness.describe_timeout(RuntimeError("Timed out in all_reduce\nmore"), 30.0)
    assert text.startswith("collective timed out after 30 s (trainer.timeout_s): every rank was waiting "
                           "(rank 0: step 4, rank 1: step 5)")  # fmt: skip
    assert text.endswith("in collectives that do not match; Timed out in all_reduce")
