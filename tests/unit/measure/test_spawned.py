"""sharded_exp.measure.spawned with stand-ins for the processes: they are never waited for
forever. The real processes are the integration tier's (test_speed, test_prediction)."""

from __future__ import annotations

import pytest

from sharded_exp.measure import spawned


class _Process:
    """A spawned process that never exits by itself (until killed)."""

    def __init__(self):
        self.killed = False

    def is_alive(self):
        return not self.killed

    def kill(self):
        self.killed = True

    def join(self, timeout=None):
        pass


class _Stuck:
    """start_processes' context for two processes that never exit."""

    def __init__(self):
        self.processes = [_Process(), _Process()]

    def join(self, timeout=None):
        return False


def test_processes_stuck_after_their_figures_came_are_killed_and_the_figures_kept(monkeypatch):
    context, asked = _Stuck(), []
    monkeypatch.setattr(spawned.mp, "start_processes", lambda *a, **kw: context)
    monkeypatch.setattr(spawned, "EXIT_GRACE_S", 0.3)
    spawned.run_spawned(print, (), 2, lambda: asked.append(1) or True, "measuring the local gloo link", limit_s=60)
    assert all(p.killed for p in context.processes) and asked  # returned, long before the limit


def test_processes_that_give_no_figures_are_killed_at_the_limit_with_an_error_naming_the_measurement(monkeypatch):
    context = _Stuck()
    monkeypatch.setattr(spawned.mp, "start_processes", lambda *a, **kw: context)
    with pytest.raises(TimeoutError, match="measuring the local gloo link: .* no figures within 0.5 s; killed"):
        spawned.run_spawned(print, (), 2, lambda: False, "measuring the local gloo link", limit_s=0.5)
    assert all(p.killed for p in context.processes)


def test_the_figures_written_by_a_measuring_process_are_read_once_there(tmp_path, monkeypatch):
    from sharded_exp.measure import machine

    out = str(tmp_path / "link.json")

    def start(*a, **kw):
        machine._write_figures(out, {"latency_s": 1.0})  # then stuck tearing down
        return _Stuck()

    monkeypatch.setattr(spawned.mp, "start_processes", start)
    monkeypatch.setattr(spawned, "EXIT_GRACE_S", 0.1)
    assert machine._in_children(print, (), 2, out, "the local gloo link") == {"latency_s": 1.0}
