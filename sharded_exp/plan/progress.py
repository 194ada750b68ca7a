"""The planner's progress on stderr: a bar in a terminal, one plain line per point in a log."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """Points done of ``total``, the time so far and the time left (from the mean time per
    point so far). In a terminal a tqdm bar redraws in place; otherwise (a log file, a
    pipe, CI) each finished point is one line: ``plan: 3/12 ddp x64 (4.1 s, ~12 s left)``."""

    def __init__(self, total: int, stream=None):
        self.total, self.count = total, 0
        self.stream = sys.stderr if stream is None else stream
        self.started = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            self.bar = tqdm(total=total, file=self.stream, unit="point", desc="plan", dynamic_ncols=True, leave=False)

    def done(self, n: int, what: str) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)
            return
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.count * (self.total - self.count)
        tail = f", ~{left:.0f} s left" if self.count < self.total else ""
        print(f"plan: {self.count}/{self.total} {what} ({elapsed:.1f} s{tail})", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
