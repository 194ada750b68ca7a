"""sharded_exp.launch.beside: the peak predicted in a thread of the parent and handed to rank 0
through the rendezvous store, with a stand-in for the fake step. Real ranks beside a real
prediction are tests/integration/test_prediction.py's."""

from __future__ import annotations

import datetime
import json
import threading

import pytest
import torch.distributed as dist

from sharded_exp.errors import WontFit
from sharded_exp.launch.beside import PEAK_KEY, PeakBeside, late_peak


class Check:
    """A PeakCheck's stand-in: predicts once ``release`` is set, or raises ``error``."""

    def __init__(self, peak=None, error=None):
        self.peak, self.error, self.release = peak, error, threading.Event()

    def predict(self):
        assert self.release.wait(30)
        if self.error is not None:
            raise self.error
        return self.peak


def test_the_peak_is_handed_over_through_the_store_once_predicted():
    peak = {"per_rank_mib": [3.5, 3.25], "flops_per_step": 12, "error": None}
    store, seen = dist.HashStore(), []
    beside = PeakBeside(Check(peak), on_done=seen.append)
    beside.start(store)
    assert beside.refused() is None and not store.check([PEAK_KEY])  # still predicting: nothing handed yet
    beside.check.release.set()
    assert beside.wait() == peak and seen == [peak] and beside.ended is not None
    assert json.loads(store.get(PEAK_KEY)) == peak and beside.refused() is None


def test_a_refusal_hands_rank_0_a_null_peak_and_is_raised_in_the_waiting_thread():
    refusal = WontFit("the job needs about 9,000 MiB of host memory")
    store = dist.HashStore()
    beside = PeakBeside(Check(error=refusal), on_done=lambda peak: pytest.fail("no peak to report"))
    beside.start(store)
    beside.check.release.set()
    with pytest.raises(WontFit) as raised:
        beside.wait()
    assert raised.value is refusal and beside.refused() is refusal
    # rank 0 is not left waiting for a peak that will never come: a null figure and why
    assert json.loads(store.get(PEAK_KEY)) == {"per_rank_mib": None, "error": f"no prediction: {refusal}"}


def test_an_error_after_the_handover_still_ends_the_prediction_with_it():
    store = dist.HashStore()
    beside = PeakBeside(Check({"per_rank_mib": [1.0]}), on_done=lambda peak: (_ for _ in ()).throw(OSError("full")))
    beside.start(store)
    beside.check.release.set()
    with pytest.raises(OSError, match="full"):
        beside.wait()
    assert json.loads(store.get(PEAK_KEY)) == {"per_rank_mib": [1.0]}  # what rank 0 got stays as it was


def test_waiting_for_a_prediction_never_started_is_a_mistake_said_at_once():
    with pytest.raises(RuntimeError, match="never started"):
        PeakBeside(Check()).wait()


def test_rank_0_reads_the_peak_from_the_parents_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    wait = late_peak({"host": "127.0.0.1", "port": server.port}, datetime.timedelta(seconds=30))
    server.set(PEAK_KEY, json.dumps({"per_rank_mib": [2.0], "speed": {"step_time_s": 0.01}}))
    assert wait() == {"per_rank_mib": [2.0], "speed": {"step_time_s": 0.01}}
