"""A job as a user starts it in a terminal, in the background, and its process tree:
started, waited for, finished, and what is left of it afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers.jobs import ROOT, TINY

LONG = [o for o in TINY if not o.startswith("trainer.steps")] + ["trainer.steps=100000"]
"""A job that runs until it is stopped (or a fault ends it)."""


def huge_pages_always() -> bool:
    """Whether the kernel backs memory with transparent huge pages always: a mapping is then
    faulted in 2 MiB at a time, not in 4 KiB pages (a test counting pages skips there)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (ranks, the forkserver)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def survivors(tree: set[int], within: float = 10.0) -> list[str]:
    """Processes of ``tree`` still alive after ``within`` seconds (the forkserver and
    multiprocessing's resource tracker leave once they see the job's pipes close)."""
    end = time.time() + within
    while time.time() < end and any(alive(p) for p in tree):
        time.sleep(0.2)
    out = []
    for pid in tree:
        if alive(pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(bytes(1), b" ").decode()
            out.append(f"{pid}: {cmdline[:200]}")
    return out


def start_job(args, log, env=None):
    """The job in the background, its output in ``log``, in a process group of its own
    (like a job in a terminal)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sharded_exp", *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_until(ready, proc, log, timeout=120):
    end = time.time() + timeout
    while not ready():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < end, "the job never got there: " + log.read_text()[-3000:]
        time.sleep(0.1)


def kill_tree(proc) -> None:
    """SIGKILL ``proc`` and every process below it: its process group when it leads one, and
    the descendants in sessions of their own (torchrun starts its ranks so), which would
    otherwise outlive it, a hung one forever."""
    tree = descendants(proc.pid)
    if os.getpgid(proc.pid) == proc.pid:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc, log=None, timeout: float = 300) -> tuple[int, str]:
    """Wait for ``proc`` and return its exit code and output: the ``log`` file it writes to, or
    its piped stdout and stderr. Past ``timeout`` it is killed with every process below it
    (:func:`kill_tree`) and the timeout raised."""
    try:
        if log is None:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out + err
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        proc.wait(timeout=30)
        raise
    return proc.returncode, log.read_text()
