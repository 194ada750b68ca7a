"""What an out-of-memory leaves behind on CUDA: the allocator's memory history, as a file.

While it records (``torch.cuda.memory._record_memory_history``, a private torch API), the
caching allocator keeps the last :data:`MAX_ENTRIES` allocations and frees with the Python
stack that made them. On an OOM each rank that ran out dumps it to
``memory_snapshot_rank<r>.pickle`` in the run directory; drag that file onto
https://pytorch.org/memory_viz to see every live block, who allocated it, and the
timeline up to the failure.

``trainer.memory_snapshot``: ``auto`` records when ``trainer.memory_limit_mib`` is set (a
run that asks whether it fits) and dumps on OOM; ``oom`` records always and dumps on OOM;
``always`` also dumps at the end of a run that fits; ``off`` never records. Recording costs
a few microseconds per allocation (``benchmarks/features/memory_history_cost.py`` measures it).

Measuring never breaks training: every call is guarded; a failure leaves a null path and
its reason.
"""

from __future__ import annotations

import os
from typing import Any

import torch

MAX_ENTRIES = 100_000
"""Allocator events kept (a ring buffer): a few KB each with their stacks, so a snapshot
file is some tens of MB at most."""


def snapshot_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, f"memory_snapshot_rank{rank}.pickle")


def _mode(setting: Any, limit_mib: float | None) -> str:
    setting = str(setting)
    if setting == "auto":
        return "oom" if limit_mib else "off"
    return setting


class MemoryHistory:
    """The CUDA allocator's history on one rank, from before the model is built."""

    def __init__(self, setting: Any, device: torch.device, limit_mib: float | None, output_dir: str, rank: int):
        self.setting = str(setting)
        self.mode = _mode(setting, limit_mib)
        self.path = snapshot_path(output_dir, rank)
        self.recording = False
        self.recorded = False
        """Whether the history was recorded (its cost is in this run's step times)."""
        self.reason: str | None = None
        """Why there is no snapshot file (not recording, or a call that failed), or None."""
        self.written: str | None = None
        if device.type != "cuda":
            self.reason = "no CUDA allocator to record on CPU (memory.oom_breakdown holds the CPU tracker's)"
        elif self.mode == "off":
            why = "no trainer.memory_limit_mib" if self.setting == "auto" else "trainer.memory_snapshot=off"
            self.reason = f"not recorded ({why})"
        else:
            try:
                # Python stacks only: C++ frames cost more per allocation and take long to
                # symbolise when dumped.
                torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=MAX_ENTRIES)
                self.recording = self.recorded = True
            except Exception as exc:  # noqa: BLE001 -- measuring never breaks training
                self.reason = f"could not record the allocator's history: {type(exc).__name__}: {exc}"[:300]

    def dump(self) -> None:
        """Write the snapshot file (once, while recording); on failure, the reason."""
        if not self.recording or self.written:
            return
        try:
            torch.cuda.memory._dump_snapshot(self.path)
            self.written = self.path
        except Exception as exc:  # noqa: BLE001 -- as above
            self.reason = f"could not write {self.path}: {type(exc).__name__}: {exc}"[:300]

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            try:
                torch.cuda.memory._record_memory_history(None)
            except Exception:  # noqa: BLE001 -- nothing more is recorded either way
                pass

    def record(self) -> dict[str, Any]:
        """This rank's ``memory_snapshot`` in result.json."""
        return {
            "setting": self.setting,
            "recorded": self.recorded,
            "path": self.written,
            "reason": None if self.written else self.reason or "no out-of-memory: nothing to dump",
        }
