"""Full disks, made for real (the ``small_fs`` fixture of tests/conftest.py mounts one)."""

from __future__ import annotations

import shutil


def fill(directory, leave_bytes: int) -> None:
    """Fill the filesystem of ``directory`` until ``leave_bytes`` are free."""
    with open(directory / "filler", "wb") as f:
        free = shutil.disk_usage(directory).free
        f.write(bytes(max(0, free - leave_bytes)))
