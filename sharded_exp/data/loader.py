"""Training batches of a user's dataset: a DataLoader per rank (not a task: nothing registers here).

A task with a ``dataset`` (data=text_file, conll, hf_dataset, custom) is read through a
``torch.utils.data.DataLoader`` with a :class:`~torch.utils.data.DistributedSampler`: each
rank reads its own shard of every epoch, the shuffle is seeded by (``data.seed``, epoch)
(``set_epoch``), and the tail that would leave ranks with unequal shares is dropped
(``drop_last``), so every rank runs the same number of micro-batches per epoch and the
epochs end together. ``data.num_workers`` worker processes make the batches (their
padding is the task's ``collate``); on CUDA they come in pinned memory and are copied
without blocking.

Deterministic resume: the loader counts the micro-batches the training consumed (not the
ones its workers made ahead) as the position ``{"epoch", "samples"}`` (global samples into
that epoch), which a checkpoint stores. A resumed run starts its epoch's sampler at that
sample and sees exactly the batches the uninterrupted run would have seen (same world size
and batch size; another world size continues from the same epoch and sample count, with
another split of the samples over the ranks). The position also records which data it is
in (length, path, content: :func:`data_changes`), so a resume on changed data says so.

The trainer times each :meth:`StepLoader.get` as the step's data time, apart from the step.
"""

from __future__ import annotations

import logging
import multiprocessing as mp

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.data import DataLoader, DistributedSampler

from sharded_exp.data import Batch, Task, each_tensor
from sharded_exp.data.prefetch import Prefetcher
from sharded_exp.errors import ConfigError

log = logging.getLogger(__name__)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that starts its epoch ``skip`` indices in (a resumed epoch)."""

    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def batches_per_epoch(dataset_len: int, world_size: int, batch_size: int) -> int:
    """Micro-batches each rank reads per epoch (both tails dropped)."""
    return (dataset_len // world_size) // batch_size


def check_fits(task: Task, world_size: int, batch_size: int, data_name: str) -> None:
    """Refuse a dataset that holds less than one global micro-batch."""
    n = len(task.dataset)
    if batches_per_epoch(n, world_size, batch_size) < 1:
        raise ConfigError(
            f"data={data_name} has {n} sample{'' if n == 1 else 's'}, fewer than one micro-batch of every rank "
            f"(trainer.batch_size={batch_size} x {world_size} ranks = {batch_size * world_size}): "
            "use more data, a smaller batch or fewer ranks"
        )


class StepLoader:
    """``get(step)``: the step's ``grad_accum`` micro-batches on the device (the Prefetcher's interface)."""

    def __init__(
        self,
        task: Task,
        rank: int,
        world_size: int,
        batch_size: int,
        grad_accum: int,
        device: torch.device,
        start: int = 0,
        position: dict | None = None,
    ):
        self.grad_accum, self.device = grad_accum, device
        self.ahead = task.num_workers > 0
        """Whether batches are made ahead (by worker processes)."""
        self.global_batch = batch_size * world_size
        self.sampler = ResumableSampler(
            task.dataset, num_replicas=world_size, rank=rank, shuffle=task.shuffle, seed=task.seed, drop_last=True
        )
        self.per_epoch = batches_per_epoch(len(task.dataset), world_size, batch_size)
        self.identity = data_identity(task)
        if position is None:  # a fresh run, or a checkpoint without a data position: the step says it
            self.epoch, self.batch = divmod(start * grad_accum, self.per_epoch)
        else:
            self.epoch = int(position["epoch"])
            self.batch, rest = divmod(int(position["samples"]), self.global_batch)
            if rest and rank == 0:
                log.warning(
                    "warning: the checkpoint's data position (%s samples into epoch %d) is not a whole number "
                    "of this run's global micro-batches (%d); resuming from micro-batch %d",
                    position["samples"],
                    self.epoch,
                    self.global_batch,
                    self.batch,
                )
            self.epoch, self.batch = self.epoch + self.batch // self.per_epoch, self.batch % self.per_epoch
        self.loader = DataLoader(
            task.dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=task.num_workers,
            collate_fn=task.collate,
            pin_memory=device.type == "cuda",
            drop_last=True,
            persistent_workers=task.num_workers > 0,
            # Workers forked from the rank: a rank started by the forkserver would otherwise start
            # them through it, which fails ("too many fds") once the rank holds its process group.
            multiprocessing_context="fork" if task.num_workers > 0 and "fork" in mp.get_all_start_methods() else None,
        )
        self._iter = None

    def position(self) -> dict[str, int | str]:
        """Where the training stands in the data: the epoch and the global samples consumed in
        it; and which data that is (:func:`data_identity`)."""
        return {"epoch": self.epoch, "samples": self.batch * self.global_batch, **self.identity}

    def _next(self) -> Batch:
        if self._iter is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.skip = self.batch * self.loader.batch_size
            self._iter = iter(self.loader)
        batch = next(self._iter)
        self.batch += 1
        if self.batch == self.per_epoch:  # the iterator is spent: the next call opens the next epoch
            self.epoch, self.batch, self._iter = self.epoch + 1, 0, None
        return batch

    def get(self, step: int) -> list[Batch]:
        """The next step's micro-batches (the loader is a stream: ``step`` is for the interface)."""
        # Made unseen by the CPU memory tracker (a dispatch mode): a dataset item that is a
        # view of the dataset's own big tensor would count that whole storage as training
        # memory. The batch itself is then copied to the device: on CPU a clone, counted as
        # the step's input, as a GPU's allocator counts the copy.
        with _disable_current_modes():
            host = [self._next() for _ in range(self.grad_accum)]
        if self.device.type == "cpu":
            return [each_tensor(b, torch.clone) for b in host]
        return [each_tensor(b, lambda v: v.to(self.device, non_blocking=True)) for b in host]

    def close(self) -> None:
        self._iter = None  # ends the workers (persistent ones with the loader)
        self.loader = None


def data_identity(task: Task) -> dict[str, int | str]:
    """What a checkpoint's data position records of the data: its length, and where it came
    from and what it held (the task's fingerprint: path and content)."""
    return {"length": len(task.dataset), **(task.fingerprint or {})}


def data_changes(position: dict | None, task: Task) -> list[dict]:
    """What differs between the data a checkpoint's position was in and this run's, as
    result.json's ``resume_changes`` records it (``data.length``, ``data.path``,
    ``data.content``; the checkpoint's value and this run's). Not refused: training on
    more, fewer or edited samples may be the point; but the position then names other
    samples, and a run that does not say so looks like a deterministic resume. A checkpoint
    written before these were recorded compares nothing."""
    if not position or task.dataset is None:
        return []
    now = data_identity(task)
    return [
        {"key": f"data.{key}", "checkpoint": position[key], "config": now[key]}
        for key in ("length", "path", "content")
        if key in position and key in now and position[key] != now[key]
    ]


def step_loader(
    task: Task, rank: int, world_size: int, loop, device: torch.device, start: int, position=None, quiet_until: int = 0
):
    """The trainer's batch source: a :class:`StepLoader` for a task with a dataset, else the
    synthetic tasks' :class:`~sharded_exp.data.prefetch.Prefetcher`, which makes no batch
    ahead beside a step before ``quiet_until`` (the CPU memory tracker's)."""
    if task.dataset is not None:
        return StepLoader(task, rank, world_size, loop.batch_size, loop.grad_accum, device, start, position)
    return Prefetcher(task, rank, loop.grad_accum, device, loop.steps, quiet_until)
