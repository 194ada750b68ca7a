"""The next step's batches, made while this step runs (not a task: nothing registers here).

A task makes a batch on the host from (step, micro, rank), so step ``s + 1``'s batches can
be made in a background thread during step ``s``; on CUDA they go to pinned memory and
are copied without blocking. A background thread is not free: while the step runs Python
it gets the GIL once per switch interval (5 ms), so batches that take less than that to
make are made in the loop (a 0.03 ms MLP batch waited 5 ms when prefetched). The first
two steps make theirs in the loop and time it; if the second took longer than the switch
interval, later steps' batches are made ahead, but never beside a step the CPU memory
tracker measures (``quiet_until``): its dispatch mode belongs to the training thread, so a
batch made in another thread would be missing from the peak it finds. The trainer times each ``get`` (waiting for the batches plus
the copy to the device) and reports it as ``data_time_s_per_step`` beside the step time:
a data bottleneck is visible on any device. Batches stay a pure function of their keys,
so prefetching changes no number the run computes.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sharded_exp.data import Batch, Task


class Prefetcher:
    def __init__(self, task: Task, rank: int, grad_accum: int, device: torch.device, end: int, quiet_until: int = 0):
        self.task, self.rank, self.grad_accum, self.device, self.end = task, rank, grad_accum, device, end
        self.quiet_until = quiet_until
        """Steps before this one run with no batches made beside them (the CPU tracker's window)."""
        self.pin = device.type == "cuda"
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None
        self._made_in_loop = 0
        self.make_s: float | None = None
        """Seconds the second step's batches took to make in the loop (None before it)."""

    @property
    def ahead(self) -> bool:
        """Whether batches are made ahead, in a background thread."""
        return self._pool is not None

    def _host(self, step: int) -> list[Batch]:
        batches = [self.task(step, m, self.rank) for m in range(self.grad_accum)]
        if self.pin:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return batches

    def get(self, step: int) -> list[Batch]:
        """Step ``step``'s micro-batches on the device; starts making the next step's."""
        if self._ahead is not None and self._ahead[0] == step:
            host = self._ahead[1].result()
        else:  # the first steps, a cheap task, or a step the loop jumped to
            t0 = time.perf_counter()
            host = self._host(step)
            self._made_in_loop += 1
            if self._made_in_loop == 2:
                self.make_s = time.perf_counter() - t0
                if self.make_s > sys.getswitchinterval():
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches")
        if self._pool is not None and self.quiet_until <= step and step + 1 < self.end:
            self._ahead = (step + 1, self._pool.submit(self._host, step + 1))
        return [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in host]

    def position(self) -> None:
        """None: a synthetic task's position in its data is the step itself."""
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
