"""sharded_exp/plan/progress.py: the planner's progress, one plain line per finished point in a
log (the time left from the mean time per point so far), a tqdm bar in a terminal. The clock
is a stand-in, so the times are known."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from sharded_exp.plan import progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=c))
    return c


def test_each_point_done_is_a_line_with_the_time_so_far_and_left(clock):
    stream = io.StringIO()
    p = progress.Progress(5, stream=stream)
    clock.now += 4.0
    p.done(1, "ddp x64")
    clock.now += 6.0
    p.done(2, "fsdp")  # 10 s for 3 points: 3.3 s each, 2 left
    assert stream.getvalue().splitlines() == [
        "plan: 1/5 ddp x64 (4.0 s, ~16 s left)",
        "plan: 3/5 fsdp (10.0 s, ~7 s left)",
    ]


def test_the_last_point_says_no_time_left(clock):
    stream = io.StringIO()
    p = progress.Progress(2, stream=stream)
    clock.now += 1.25
    p.done(2, "zero1")
    assert stream.getvalue() == "plan: 2/2 zero1 (1.2 s)\n"
    p.close()  # nothing to close in a log


def test_a_terminal_gets_a_bar_that_counts_the_points(clock):
    stream = Terminal()
    p = progress.Progress(4, stream=stream)
    assert p.bar is not None and p.bar.total == 4
    p.done(3, "ddp")
    assert p.bar.n == 3 and p.count == 3
    assert "plan: 3/4" not in stream.getvalue()  # no log line
    p.close()


def test_progress_goes_to_stderr_by_default(clock, capsys):
    p = progress.Progress(1)
    p.done(1, "oss")
    assert capsys.readouterr().err == "plan: 1/1 oss (0.0 s)\n"
