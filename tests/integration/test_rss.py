"""A rank's resident memory (``peak_rss_mib``) against what it tracks (``peak_allocated_mib``), at 8 ranks.

Growth is read against the same stack at tiny width, so torch's own resident set drops out.
Under glibc's dynamic mmap threshold (a plain script's rule, and the ranks' default) a FSDP
rank's resident set grows several times its tracked peak: each unit's freed gather raises the
threshold and later gathers are carved from the heap, which keeps them resident
(docs/concepts/memory.md, "On CPU: resident memory"). ``trainer.host_mmap_threshold=fixed``
(sharded_exp/measure/host_malloc.py) spares it; the test at 8 ranks runs under that lever.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.helpers.jobs import ROOT, launch_job

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A fresh process (a long-lived one's heap may hold a free chunk that serves the request before
# any threshold is asked): a block of argv[2] MiB freed and asked for again; where does the second land?
SECOND_BLOCK = """
import ctypes, sys
from sharded_exp.measure.host_malloc import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold({}) == 4 * 2**20
size = int(float(sys.argv[2]) * 2**20)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(size))
second = libc.malloc(size)
heaps = [line.split()[0].split("-") for line in open("/proc/self/maps") if "[heap]" in line]
print("heap" if any(int(lo, 16) <= second < int(hi, 16) for lo, hi in heaps) else "mapped")
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's dynamic mmap threshold only")
def test_a_freed_large_block_no_longer_raises_the_threshold():
    """With the threshold fixed (what a rank does first under ``fixed``), an 8 MiB block freed and asked for
    again is mapped anew and goes back to the kernel when freed; left dynamic, the free raises the
    threshold to 8 MiB and the second block is carved from the heap (where it stays resident).
    A 1 MiB block, below the fixed threshold, comes from the heap and is reused: not new pages
    (and page faults) every step, as it was with the threshold fixed at glibc's 128 KiB."""

    def second(how: str, mib: float) -> str:
        proc = subprocess.run([sys.executable, "-c", SECOND_BLOCK, how, str(mib)], cwd=ROOT, capture_output=True,
                              text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120,
                              check=True)  # fmt: skip
        return proc.stdout.strip()

    assert second("fixed", 8) == "mapped"
    assert second("dynamic", 8) == "heap"  # the rule the fix turns off: the check can fail
    assert second("fixed", 1) == "heap"


STACK = [
    "model.depth=16",
    "trainer.world_size=8",
    "trainer.steps=3",
    "trainer.warmup_steps=2",
    "trainer.host_mmap_threshold=fixed",
]  # the lever that spares a FSDP rank's freed gathers
WIDE, NARROW = "model.hidden=1024", "model.hidden=32"  # 4 MiB per weight (at the fixed threshold), and tiny


def _growth(strategy: str, tmp_path) -> dict[str, float]:
    """The largest rank's peak RSS at WIDE minus at NARROW; at WIDE the largest tracked peak and
    the largest of what the tracker may miss at it: a tensor gloo's worker thread freed after the
    training thread moved on, and one unit's gathered parameters (FSDP's transient)."""
    runs = {}
    for width in (WIDE, NARROW):
        result = launch_job([f"strategy={strategy}", *STACK, width], tmp_path / f"{strategy}_{width[-4:]}")
        assert result["status"] == "ok", result.get("error")
        runs[width] = result["memory"]
    wide = runs[WIDE]
    return {
        "rss": wide["peak_rss_mib_max"] - runs[NARROW]["peak_rss_mib_max"],
        "tracked": wide["peak_allocated_mib_max"],
        "late": max(r.get("freed_off_thread_max_mib") or 0.0 for r in wide["per_rank"]),
        "unit": wide.get("transient_params_mib_max") or 0.0,  # FSDP only
        "heap_free": max(r["heap_free_mib"] for r in wide["per_rank"]),
    }


@pytest.mark.slow
def test_a_fsdp_rank_grows_less_than_a_ddp_rank_and_holds_only_what_it_tracks(tmp_path):
    """Left to glibc's dynamic threshold, this stack's FSDP rank grew 330 MiB with 46 tracked
    (a DDP rank 336 with 314): the second assertion failed by 276 MiB. With the threshold fixed
    at 4 MiB it grows 57 for 46 tracked, a 4 MiB late buffer and a 4 MiB gather: the rest is
    heap blocks below the threshold freed and kept (``heap_free_mib``)."""
    fsdp, ddp = _growth("fsdp", tmp_path), _growth("ddp", tmp_path)
    assert fsdp["rss"] < ddp["rss"], (fsdp, ddp)
    # Beyond its live tensors a FSDP rank keeps at most a buffer gloo frees late, one unit's
    # gather, and the small blocks its heap keeps free (below the 4 MiB threshold, counted by
    # glibc itself): its freed gathers go back to the kernel.
    assert fsdp["rss"] - fsdp["tracked"] <= fsdp["late"] + fsdp["unit"] + fsdp["heap_free"], fsdp
    assert fsdp["heap_free"] < fsdp["tracked"] / 2, fsdp  # the heap keeps small blocks, not gathers
