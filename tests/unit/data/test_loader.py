"""sharded_exp.data.loader: each rank's shard of a user's dataset (disjoint, equal, the tail
dropped), the epoch's reshuffle, the data position a checkpoint stores and a resume from
it, the data changes a resume reports, and which batch source a task gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sharded_exp.data import Task
from sharded_exp.data.loader import (
    ResumableSampler,
    StepLoader,
    batches_per_epoch,
    check_fits,
    data_changes,
    data_identity,
    step_loader,
)
from sharded_exp.data.prefetch import Prefetcher
from sharded_exp.errors import ConfigError
from tests.helpers.unit_config import Indexed

CPU = torch.device("cpu")


def task(n=22, shuffle=True, seed=0, fingerprint=None) -> Task:
    return Task(lambda s, m, r: {}, metric="accuracy", dataset=Indexed(n), collate=torch.utils.data.default_collate,
                seed=seed, shuffle=shuffle, fingerprint=fingerprint)  # fmt: skip


def samples(loader: StepLoader, steps: int) -> list[list[int]]:
    """Each step's micro-batches as the sample indices they hold."""
    return [[b["x"].tolist() for b in loader.get(s)] for s in range(steps)]


@pytest.mark.parametrize(
    "n, ws, bs, per_epoch", [(22, 2, 5, 2), (20, 2, 5, 2), (19, 2, 5, 1), (9, 2, 5, 0), (7, 1, 7, 1)]
)
def test_batches_per_epoch_drop_both_tails(n, ws, bs, per_epoch):
    assert batches_per_epoch(n, ws, bs) == per_epoch


def test_a_dataset_smaller_than_one_global_micro_batch_is_refused():
    check_fits(SimpleNamespace(dataset=list(range(10))), 2, 5, "custom")  # exactly one
    with pytest.raises(ConfigError, match=r"data=conll has 9 samples, fewer than one micro-batch of every rank "
                                          r"\(trainer.batch_size=5 x 2 ranks = 10\)"):  # fmt: skip
        check_fits(SimpleNamespace(dataset=list(range(9))), 2, 5, "conll")


def test_the_sampler_skips_into_its_epoch():
    s = ResumableSampler(list(range(10)), num_replicas=2, rank=1, shuffle=False, drop_last=True)
    assert list(s) == [1, 3, 5, 7, 9] and len(s) == 5
    s.skip = 2
    assert list(s) == [5, 7, 9] and len(s) == 3


def test_ranks_read_disjoint_equal_shards_of_each_epoch():
    n, ws, bs = 22, 2, 5  # 2 micro-batches per rank per epoch; 2 samples dropped
    per_rank = [
        sum((sum(step, []) for step in samples(StepLoader(task(n), r, ws, bs, 1, CPU), 2)), []) for r in range(ws)
    ]
    assert all(len(p) == 2 * bs for p in per_rank)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert len(set(per_rank[0]) | set(per_rank[1])) == 20 and set(per_rank[0]) | set(per_rank[1]) <= set(range(n))


def test_without_shuffle_ranks_take_samples_in_turn():
    loader = StepLoader(task(12, shuffle=False), 1, 2, 3, 1, CPU)
    assert samples(loader, 2) == [[[1, 3, 5]], [[7, 9, 11]]]


def test_grad_accum_takes_that_many_micro_batches_per_step():
    loader = StepLoader(task(12, shuffle=False), 0, 2, 2, 3, CPU)
    assert samples(loader, 1) == [[[0, 2], [4, 6], [8, 10]]]


def test_each_epoch_is_reshuffled_and_seeded():
    a = samples(StepLoader(task(40, seed=1), 0, 1, 40, 1, CPU), 2)
    assert sorted(a[0][0]) == sorted(a[1][0]) == list(range(40)) and a[0][0] != a[1][0]
    assert a == samples(StepLoader(task(40, seed=1), 0, 1, 40, 1, CPU), 2)
    assert a != samples(StepLoader(task(40, seed=2), 0, 1, 40, 1, CPU), 2)


def test_the_position_counts_global_samples_into_the_epoch_and_rolls_over():
    loader = StepLoader(task(22, fingerprint={"path": "/d", "content": "sha256:x"}), 0, 2, 5, 1, CPU)
    assert loader.position() == {"epoch": 0, "samples": 0, "length": 22, "path": "/d", "content": "sha256:x"}
    loader.get(0)
    assert loader.position()["samples"] == 10  # 5 per rank x 2 ranks
    loader.get(1)
    assert (loader.position()["epoch"], loader.position()["samples"]) == (1, 0)


def test_a_resume_from_a_position_sees_the_batches_the_uninterrupted_run_saw():
    whole = StepLoader(task(30), 1, 2, 3, 1, CPU)
    seen = samples(whole, 9)  # 5 micro-batches per epoch: crosses into epoch 1
    first = StepLoader(task(30), 1, 2, 3, 1, CPU)
    samples(first, 6)
    resumed = StepLoader(task(30), 1, 2, 3, 1, CPU, position=first.position())
    assert samples(resumed, 3) == seen[6:]


def test_a_start_step_without_a_position_counts_micro_batches_from_the_step():
    loader = StepLoader(task(30), 0, 2, 3, 2, CPU, start=3)  # 6 micro-batches: epoch 1, batch 1
    assert (loader.epoch, loader.batch) == (1, 1)


def test_a_position_of_more_than_an_epoch_rolls_into_the_next_ones():
    loader = StepLoader(task(30), 0, 2, 3, 1, CPU, position={"epoch": 1, "samples": 6 * 7})  # 7 global batches
    assert (loader.epoch, loader.batch) == (2, 2)  # 5 per epoch


def test_a_position_not_a_whole_number_of_batches_resumes_at_the_batch_it_is_in(caplog):
    loader = StepLoader(task(30), 0, 2, 3, 1, CPU, position={"epoch": 0, "samples": 8})
    assert (loader.epoch, loader.batch) == (0, 1)
    assert "not a whole number of this run's global micro-batches" in caplog.text


def test_cpu_batches_are_copies_not_the_datasets_tensors():
    t = task(4, shuffle=False)
    loader = StepLoader(t, 0, 1, 2, 1, CPU)
    b = loader.get(0)[0]
    assert b["x"].tolist() == [0, 1]
    loader.close()
    assert loader.loader is None


def test_data_identity_is_the_length_and_the_fingerprint():
    assert data_identity(task(5)) == {"length": 5}
    assert data_identity(task(5, fingerprint={"path": "p", "content": "c"})) == {
        "length": 5,
        "path": "p",
        "content": "c",
    }


def test_data_changes_name_each_key_that_differs():
    now = task(5, fingerprint={"path": "/new", "content": "c1"})
    old = {"epoch": 0, "samples": 0, "length": 4, "path": "/old", "content": "c1"}
    assert data_changes(old, now) == [
        {"key": "data.length", "checkpoint": 4, "config": 5},
        {"key": "data.path", "checkpoint": "/old", "config": "/new"},
    ]
    assert data_changes({"epoch": 0, "samples": 0, "length": 5}, now) == []  # an older checkpoint: length only
    assert data_changes(None, now) == [] and data_changes({}, now) == []
    assert data_changes(old, Task(lambda s, m, r: {}, metric="accuracy")) == []  # a synthetic task


def test_a_task_with_a_dataset_gets_a_step_loader_and_a_synthetic_one_the_prefetcher():
    loop = SimpleNamespace(batch_size=2, grad_accum=1, steps=3)
    loader = step_loader(task(8), 0, 2, loop, CPU, 0)
    assert isinstance(loader, StepLoader)
    synthetic = step_loader(Task(lambda s, m, r: {"x": torch.zeros(1)}, metric="accuracy"), 0, 2, loop, CPU, 0)
    assert isinstance(synthetic, Prefetcher) and synthetic.position() is None
    synthetic.close()
