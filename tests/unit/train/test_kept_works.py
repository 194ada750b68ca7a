"""kept_works: gathers whose gloo works this process lets go of, not gloo's worker thread."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sharded_exp.train import kept_works


def test_all_gather_object_returns_each_ranks_object_and_keeps_both_of_its_works(gloo_group):
    obj = {"rank": 0, "peak_mib": 12.5, "nested": [1, "two", None], "tensor_free": True}
    before = kept_works.kept()
    gathered = kept_works.all_gather_object(obj)
    assert gathered == [obj]
    new = [w for w in kept_works.kept() if not any(w is b for b in before)]
    # the sizes' gather and the payloads': held here as works, so gloo's thread never drops them last
    assert len(new) == 2 and all(isinstance(w, dist.Work) for w in new)


def test_the_gather_stays_on_the_cpu_whatever_the_default_device(gloo_group):
    """A user's ``torch.set_default_device`` does not move the gather's tensors (gloo takes CPU ones)."""
    big = list(range(50_000))
    with torch.device("meta"):
        assert kept_works.all_gather_object(big) == [big]


def test_the_kept_works_are_bounded_the_oldest_pushed_out_first():
    marks = [object() for _ in range(kept_works.KEPT_WORKS + 5)]
    for m in marks:
        kept_works.keep(m)
    held = kept_works.kept()
    assert len(held) == kept_works.KEPT_WORKS and held[0] is marks[5] and held[-1] is marks[-1]
    assert kept_works.keep(None) is None and kept_works.kept()[-1] is marks[-1]


def test_a_group_of_cpu_gloo_and_cuda_nccl_gathers_over_gloo(gloo_group, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "all_gather_object", None)  # not called
    assert kept_works.all_gather_object([1.5]) == [[1.5]]


def test_a_group_on_nccl_alone_takes_torchs_own_gather(gloo_group, monkeypatch):
    calls = []

    def torchs(out, obj):
        calls.append(obj)
        out[0] = obj

    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "all_gather_object", torchs)
    assert kept_works.all_gather_object({"a": torch.tensor(1).item()}) == [{"a": 1}] and calls == [{"a": 1}]
