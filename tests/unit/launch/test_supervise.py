"""sharded_exp.launch.supervise, in-process with fake rank processes: which rank is named as
the first failure, how a rank's death is said, and how the parent stops its ranks. Real
ranks, signals and timeouts are tests/integration/test_failures.py's."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from sharded_exp.launch import supervise


class Queue:
    """The ranks' "finished" queue: what they sent, in order."""

    def __init__(self, *messages):
        self.messages = list(messages)

    def empty(self):
        return not self.messages

    def get(self):
        message = self.messages.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message


class Proc:
    def __init__(self, exitcode=None, pid=0):
        self.exitcode, self.pid, self.killed = exitcode, pid, False

    def is_alive(self):
        return self.exitcode is None and not self.killed

    def kill(self):
        self.killed = True

    def join(self):
        pass


def test_a_rank_death_is_said_with_its_signal_or_exit_code():
    killed = str(supervise.RankDied(1, -signal.SIGKILL))
    assert killed.startswith("rank 1: killed by signal 9 (SIGKILL)") and "OOM killer" in killed
    assert str(supervise.RankDied(0, -signal.SIGTERM)) == "rank 0: killed by signal 15 (SIGTERM)"
    assert "exited with code 0 before it finished training" in str(supervise.RankDied(2, 0))
    assert str(supervise.RankDied(3, 1)) == "rank 3: process exited with code 1"


def test_a_rank_that_exited_0_without_finishing_is_found_after_reading_what_it_sent():
    finished = {}
    processes = [Proc(exitcode=0), Proc(exitcode=0), Proc()]
    # rank 0 sent its payload, then exited: read now, it is not blamed; rank 1 sent nothing
    assert supervise._exited_unfinished(processes, finished, Queue((0, "payload"))) == 1
    assert finished == {0: "payload"}
    assert supervise._exited_unfinished(processes, {0: "p", 1: None}, Queue()) is None


def test_the_rank_without_a_record_is_the_first_failure(tmp_path):
    context = SimpleNamespace(processes=[Proc(exitcode=1), Proc(exitcode=1)])
    (tmp_path / "rank0_error.json").write_text("{}")
    first = supervise._first_failure(RuntimeError("x"), context, Queue(), {}, str(tmp_path))
    assert str(first) == "rank 1: process exited with code 1"
    (tmp_path / "rank1_error.json").write_text("{}")  # both recorded: their records say it
    assert supervise._first_failure(RuntimeError("x"), context, Queue(), {}, str(tmp_path)) is None


def test_a_rank_killed_after_losing_its_peer_is_blamed_only_when_it_lost_one(tmp_path):
    context = SimpleNamespace(processes=[Proc(exitcode=-signal.SIGTERM), Proc(exitcode=1)])
    (tmp_path / "rank1_error.json").write_text("{}")
    lost = supervise._first_failure(RuntimeError("Connection reset by peer"), context, Queue(), {}, str(tmp_path))
    assert str(lost) == "rank 0: killed by signal 15 (SIGTERM)"
    assert supervise._first_failure(RuntimeError("ValueError"), context, Queue(), {}, str(tmp_path)) is None


def test_a_signal_death_torch_noticed_is_named_and_nothing_started_names_nothing(tmp_path):
    exited = supervise.mp.ProcessExitedException("died", error_index=2, error_pid=1, exit_code=-signal.SIGKILL)
    first = supervise._first_failure(exited, None, Queue(), {}, str(tmp_path))
    assert str(first).startswith("rank 2: killed by signal 9 (SIGKILL)")
    assert supervise._first_failure(OSError("no fork"), None, Queue(), {}, str(tmp_path)) is None


def test_a_second_signal_kills_the_ranks_and_the_first_reason_stays():
    stop = supervise.ParentStop(grace_s=60.0)
    alive, done = Proc(), Proc(exitcode=0)
    stop.processes = [alive, done]
    stop._kill("at a second signal, SIGINT")
    stop._kill("later")
    assert alive.killed and not done.killed
    assert stop.killed == "at a second signal, SIGINT"


def test_the_same_signal_delivered_twice_at_once_is_one_stop_and_a_later_or_other_one_kills():
    """GNU timeout signals the job's process and then its process group: the same SIGTERM
    twice within microseconds is one stop; the same signal a second later, or another
    signal, is a second stop asked on purpose."""
    for again, after, kills in ((signal.SIGTERM, 0.0, False), (signal.SIGTERM, 1.0, True), (signal.SIGINT, 0.0, True)):
        stop = supervise.ParentStop(grace_s=60.0)
        stop._on_signal(signal.SIGTERM, None)  # no ranks yet: nothing to pass it on to
        rank = Proc()
        stop.processes = [rank]
        stop.first_at -= after
        stop._on_signal(again, None)
        assert rank.killed is kills and stop.signum == signal.SIGTERM
        assert stop.killed == (f"at a second signal, {again.name}" if kills else None)


def test_the_stop_is_passed_on_again_each_second_until_the_ranks_end(monkeypatch):
    """A rank forked just as the stop came ignores SIGTERM until it sets its handler (the rank
    server's disposition): the parent sends it again each second, never before a signal."""
    sent = []
    monkeypatch.setattr(supervise.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    stop = supervise.ParentStop(grace_s=60.0)
    stop.processes = [Proc(pid=11), Proc(pid=12, exitcode=0)]
    stop.enforce_deadline()
    assert sent == []  # no signal yet
    stop._on_signal(signal.SIGTERM, None)
    stop.enforce_deadline()  # within the second: not again
    assert sent == [(11, signal.SIGTERM)]
    stop.relayed_at -= supervise.RELAY_EVERY_S
    stop.enforce_deadline()
    assert sent == [(11, signal.SIGTERM)] * 2 and stop.killed is None


def test_ranks_alive_past_the_grace_period_are_killed():
    stop = supervise.ParentStop(grace_s=5.0)
    rank = Proc()
    stop.processes = [rank]
    stop.enforce_deadline()  # no signal yet: no deadline
    assert not rank.killed
    stop.deadline = 0.0  # the signal came long ago
    stop.enforce_deadline()
    assert rank.killed and stop.killed == "still running trainer.stop_grace_s=5 s after the signal"


def test_stopped_says_the_signal_and_whether_ranks_were_killed():
    assert str(supervise.Stopped(signal.SIGTERM, None)) == "stopped by SIGTERM: ranks stopped"
    assert str(supervise.Stopped(signal.SIGINT, "why")) == "stopped by SIGINT: ranks were killed (why)"


def test_reading_the_ranks_messages_ends_at_the_end_of_the_pipe():
    """Once every rank has ended, their pipe reads as ended (the parent holds no writing end):
    what came is kept, and the read ends instead of raising or waiting."""
    finished = {}
    supervise._drain(Queue((1, None), (0, "payload"), EOFError()), finished)
    assert finished == {1: None, 0: "payload"}


class Store:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


def test_ranks_are_released_with_what_the_release_gives_or_killed_where_it_fails():
    import pickle

    import pytest

    from sharded_exp.errors import WontFit
    from sharded_exp.launch.rank import RELEASE_KEY

    ranks, store = [Proc(), Proc()], Store()
    given = supervise.Release(lambda: {"per_rank_mib": [3.0]}, abandon=lambda: None)
    supervise._release(ranks, store, given, supervise.ParentStop(1.0))
    assert pickle.loads(store.values[RELEASE_KEY]) == {"per_rank_mib": [3.0]} and not any(p.killed for p in ranks)

    def refuse():
        raise WontFit("the job needs about 900 MiB of host memory")

    ranks, store = [Proc(), Proc()], Store()
    with pytest.raises(supervise.Unreleased) as caught:
        supervise._release(ranks, store, supervise.Release(refuse, abandon=lambda: None), supervise.ParentStop(1.0))
    assert isinstance(caught.value.cause, WontFit) and all(p.killed for p in ranks) and not store.values


def test_a_signal_while_the_ranks_wait_for_their_release_stops_them_before_their_first_step():
    import pytest

    for release in (lambda: None, lambda: (_ for _ in ()).throw(RuntimeError("the check died: SIGTERM"))):
        stop, ranks, store = supervise.ParentStop(1.0), [Proc(), Proc()], Store()
        stop.signum = signal.SIGTERM  # came while the parent waited for the prediction
        with pytest.raises(supervise.Stopped, match="stopped by SIGTERM: ranks were killed .before their first step"):
            supervise._release(ranks, store, supervise.Release(release, abandon=lambda: None), stop)
        assert all(p.killed for p in ranks) and not store.values  # never released


def test_the_first_signal_abandons_the_wait_for_the_release():
    import pytest

    abandoned = []
    stop, ranks, store = supervise.ParentStop(1.0), [Proc(), Proc()], Store()

    def wait():  # the parent's read of the check's answer, which the signal ends (the check killed)
        stop._on_signal(signal.SIGTERM, None)
        if abandoned:
            raise RuntimeError("the process forked to run _check_there died before answering (exit code -9)")
        return {"per_rank_mib": [3.0]}

    with pytest.raises(supervise.Stopped):
        supervise._release(ranks, store, supervise.Release(wait, abandon=lambda: abandoned.append(1)), stop)
    assert abandoned == [1] and stop.abandon is None and not store.values
