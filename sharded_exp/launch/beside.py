"""The fake step's peak prediction, made beside the ranks instead of before them.

The spawning parent's last pre-flight part is the fake training step that predicts every
rank's peak (:class:`~sharded_exp.launch.preflight.PeakCheck`): about a second of CPU on the
default job, while the rank server is already waiting. Every check that needs no fake step
has refused bad input by then, so the parent starts the ranks and predicts in a thread of its
own meanwhile (a thread: the prediction needs nothing of the parent's main thread, which only
watches the ranks, and a thread shares the parent's imports, where a process would import
torch again).

The ranks need the peak only at the end: rank 0 sets it beside what it measured in its
payload (memory, model FLOPs, the predicted step time; W&B's summary reads that payload).
The parent hands it over through the rendezvous store it holds (:data:`PEAK_KEY`, as JSON).
Rank 0 takes it (:func:`late_peak`) once the warm-up steps are done, and its peers wait with
it, as they wait for W&B's start there (``train.components.AfterWarmup``): the timed steps do
not share the machine with the prediction, and no warm-up step waits for it. The store always
gets a value, a null figure and the reason when there is no prediction, so rank 0 is never left
waiting.

A prediction that refuses the job (a CPU job predicted beyond the host's memory, a model the
fake step refuses) is known only after the ranks started: the parent then stops them as a
signal would (they finish their step, agree, save if checkpointing, exit; killed if they
outlive ``trainer.stop_grace_s``) and refuses the job with the same error as before.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

if TYPE_CHECKING:  # the ranks import this module for late_peak: not pre-flight's imports
    from sharded_exp.launch.preflight import PeakCheck

log = logging.getLogger(__name__)

PEAK_KEY = "sharded_exp/predicted_peak"
"""The rendezvous store's key under which the parent hands rank 0 the predicted peak."""


class PeakBeside:
    """:meth:`PeakCheck.predict` in a thread of the parent, started with the ranks.

    ``on_done``: called in the thread with the peak once it is known (the parent writes it into
    the "running" result.json and logs it); an exception there counts as the prediction's.
    """

    def __init__(self, check: PeakCheck, on_done: Callable[[dict[str, Any]], None] | None = None):
        self.check = check
        self.on_done = on_done
        self.peak: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.ended: float | None = None
        """When the prediction ended (time.time()): result.json's timeline ``predicted``."""
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    def start(self, store) -> None:
        """Predict in a thread; the peak (or a null figure and why) goes into ``store`` for rank 0."""
        self._thread = threading.Thread(target=self._run, args=(store,), name="peak-prediction", daemon=True)
        self._thread.start()

    def _run(self, store) -> None:
        handed = False
        try:
            self.peak = self.check.predict()
            store.set(PEAK_KEY, json.dumps(self.peak))
            handed = True
            if self.on_done is not None:
                self.on_done(self.peak)
        except BaseException as exc:  # noqa: BLE001 -- raised in the parent's thread by wait()
            self.error = exc
            if not handed:  # rank 0 must not wait for a peak that will never come
                store.set(PEAK_KEY, json.dumps({"per_rank_mib": None, "error": f"no prediction: {exc}"}))
        finally:
            self.ended = time.time()
            self._done.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def refused(self) -> BaseException | None:
        """The prediction's error once it has ended with one (the job must stop), else None."""
        return self.error if self._done.is_set() else None

    def wait(self) -> dict[str, Any]:
        """The predicted peak, once the thread has ended; its error raised here, in the caller's thread."""
        if self._thread is None:
            raise RuntimeError("the peak prediction was never started")
        self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.peak is not None
        return self.peak


def late_peak(store: dict[str, Any], timeout: datetime.timedelta) -> Callable[[], dict[str, Any]]:
    """Rank 0's side: a function that waits for the parent's peak in its rendezvous store
    (``store``: host and port) and returns it; ``timeout`` (``trainer.timeout_s``) bounds the wait."""

    def wait() -> dict[str, Any]:
        client = dist.TCPStore(store["host"], store["port"], is_master=False, timeout=timeout)
        return json.loads(client.get(PEAK_KEY))

    return wait
