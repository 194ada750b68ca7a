"""sharded_exp.measure.machine_memory: the machine's memory from /proc/meminfo and the cgroup's limit."""

from __future__ import annotations

import io

from sharded_exp.measure import machine_memory
from sharded_exp.measure.machine_memory import available_mib, total_mib

MEMINFO = "MemTotal: 9437184 kB\nMemAvailable:    2097152 kB\n"  # 9216 and 2048 MiB


def _files(monkeypatch, files: dict[str, str]):
    def fake_open(path, *a, **k):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(machine_memory, "open", fake_open, raising=False)


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroups_limit_less_its_use(monkeypatch):
    cgroup = {"/sys/fs/cgroup/memory.max": str(3 * 2**30) + "\n", "/sys/fs/cgroup/memory.current": str(2**30)}
    _files(monkeypatch, {"/proc/meminfo": MEMINFO, **cgroup})
    assert available_mib() == 2048.0  # cgroup leaves 2048 too; make it smaller:
    cgroup["/sys/fs/cgroup/memory.current"] = str(2 * 2**30)
    _files(monkeypatch, {"/proc/meminfo": MEMINFO, **cgroup})
    assert available_mib() == 1024.0
    _files(monkeypatch, {"/proc/meminfo": MEMINFO, "/sys/fs/cgroup/memory.max": "max\n",
                         "/sys/fs/cgroup/memory.current": "5"})  # fmt: skip
    assert available_mib() == 2048.0
    _files(monkeypatch, {})
    assert available_mib() is None


def test_total_memory_is_the_smaller_of_memtotal_and_the_cgroups_limit(monkeypatch):
    cgroup = {"/sys/fs/cgroup/memory.max": str(4 * 2**30) + "\n", "/sys/fs/cgroup/memory.current": str(2**30)}
    _files(monkeypatch, {"/proc/meminfo": MEMINFO, **cgroup})
    assert total_mib() == 4096.0  # the limit, not less what the group uses
    _files(monkeypatch, {"/proc/meminfo": MEMINFO, "/sys/fs/cgroup/memory.max": "max\n"})
    assert total_mib() == 9216.0
    _files(monkeypatch, {"/sys/fs/cgroup/memory.max": "junk\n"})
    assert total_mib() is None


def test_this_machines_figures_are_read():
    total, available = total_mib(), available_mib()
    assert total is not None and 0 < available <= total
