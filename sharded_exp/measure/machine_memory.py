"""This machine's host memory as the kernel states it: all of it, and what is still free.

Read from ``/proc/meminfo`` and, where a container or a SLURM allocation sets one, the cgroup's
limit (cgroup v2: ``memory.max``, and ``memory.current`` for what the group uses), whichever is
smaller. The planner holds an offloading node's host figure against :func:`total_mib` (``this``
profile); a run's pre-flight holds its ranks' against :func:`available_mib`. Imports nothing heavy.
"""

from __future__ import annotations

MEMINFO = "/proc/meminfo"
CGROUP_MAX = "/sys/fs/cgroup/memory.max"
CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"


def _meminfo_mib(key: str) -> float | None:
    try:
        with open(MEMINFO) as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info[key].split()[0]) / 1024  # kB
    except (OSError, KeyError, ValueError):
        return None


def _cgroup_limit_mib(less_used: bool) -> float | None:
    """The cgroup's limit (MiB), less what the group uses when ``less_used``; None: no limit."""
    try:
        with open(CGROUP_MAX) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        used = 0
        if less_used:
            with open(CGROUP_CURRENT) as f:
                used = int(f.read())
        return (int(limit) - used) / 2**20
    except (OSError, ValueError):
        return None


def _smaller(*values: float | None) -> float | None:
    found = [v for v in values if v is not None]
    return min(found) if found else None


def total_mib() -> float | None:
    """The memory a job here may hold: MemTotal, or the cgroup's limit where smaller; None: unreadable."""
    return _smaller(_meminfo_mib("MemTotal"), _cgroup_limit_mib(less_used=False))


def available_mib() -> float | None:
    """The memory a job here can still take: MemAvailable, or the cgroup's limit less its use
    where that is smaller; None when neither is readable."""
    return _smaller(_meminfo_mib("MemAvailable"), _cgroup_limit_mib(less_used=True))
