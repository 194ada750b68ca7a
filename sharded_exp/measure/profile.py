"""``trainer.profile``: a torch.profiler trace of a few training steps per rank.

The steps right after warm-up (after the CPU memory tracker's window too) are profiled,
``trainer.profile_steps`` of them, and each rank writes ``trace_rank<r>.json`` (Chrome
trace format) into the run directory: open it in https://ui.perfetto.dev or
chrome://tracing. Profiled steps are never timed: the timed window starts after them, and
their own step times are kept beside the trace (``profile.step_time_s``) so the cost of
profiling is read from one run.

Measuring never breaks training: a profiler that fails to start, stop or export leaves
a null path and its reason; the steps go on.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch


def trace_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"trace_rank{rank}.json")


class StepProfiler:
    """Profile steps ``first`` .. ``first + count - 1`` of this rank."""

    def __init__(self, device: torch.device, path: str, first: int, count: int, note: str | None = None):
        self.device, self.path, self.first, self.count = device, path, first, count
        self.note = note
        self.steps: list[int] = []
        self.step_times: list[float] = []
        self.export_s: float | None = None
        self.error: str | None = None if count > 0 else note
        self._prof = None

    def covers(self, step: int) -> bool:
        return self.first <= step < self.first + self.count

    def _fail(self, what: str, exc: BaseException) -> None:
        self.error = f"the profiler could not {what}: {type(exc).__name__}: {exc}"[:300]
        self._prof = None

    def before_step(self, step: int) -> None:
        if step != self.first or self.error is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
        except Exception as exc:  # noqa: BLE001 -- measuring never breaks training
            self._fail("start", exc)

    def label(self, step: int):
        """The step as a named range in the trace (``step 7``)."""
        if self._prof is None or not self.covers(step):
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"step {step}")

    def after_step(self, step: int, step_time: float) -> None:
        if self._prof is None or not self.covers(step):
            return
        self.steps.append(step)
        self.step_times.append(step_time)
        if step == self.first + self.count - 1:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (also when the loop stopped inside the profiled steps)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        t0 = time.perf_counter()
        try:
            prof.stop()
            prof.export_chrome_trace(self.path)
            self.export_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 -- as above
            self._fail("write its trace", exc)

    def record(self) -> dict[str, Any]:
        """This rank's ``profile`` in result.json."""
        written = self.error is None and self.export_s is not None
        return {
            "path": self.path if written else None,
            "steps": self.steps,
            "size_mib": os.path.getsize(self.path) / 2**20 if written else None,
            "step_time_s": self.step_times,
            "export_s": self.export_s,
            "note": self.note,
            "error": None if written else self.error or "no profiled step ran",
        }
