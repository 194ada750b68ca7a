"""kept_works' gather at two real gloo ranks: objects of different sizes, each whole, in rank order.

Slow tier: every multi-rank job of the default tier gathers its ranks' figures through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _gather(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from sharded_exp.train import kept_works

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = {"rank": rank} if rank == 0 else {"rank": rank, "long": list(range(20_000)), "none": None}
    gathered = kept_works.all_gather_object(mine)
    again = kept_works.all_gather_object(f"short {rank}")  # a second gather, each object cut to its own size
    path = Path(out, f"rank{rank}.json")
    path.with_suffix(".tmp").write_text(json.dumps([gathered, again, len(kept_works.kept())]))
    path.with_suffix(".tmp").rename(path)  # whole when it appears: the test reads it as soon as it exists
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gather_objects_of_different_sizes_whole_and_in_rank_order(tmp_path):
    from sharded_exp.measure.spawned import run_spawned

    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    run_spawned(_gather, (str(tmp_path / "store"), str(tmp_path)), 2, lambda: all(f.exists() for f in files),
                "kept_works' gather", limit_s=300)  # fmt: skip
    expected = [[{"rank": 0}, {"rank": 1, "long": list(range(20_000)), "none": None}], ["short 0", "short 1"], 4]
    assert [json.loads(f.read_text()) for f in files] == [expected, expected]
