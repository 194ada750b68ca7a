"""Datasets and factories the data unit tests name as ``data._target_`` (importable by path)."""

from __future__ import annotations

import torch


class Indexed(torch.utils.data.Dataset):
    """Item i: {"x": i, "labels": i % 3} (which sample a batch holds is read off it)."""

    def __init__(self, n: int = 10):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor(i), "labels": torch.tensor(i % 3)}


class Pairs(Indexed):
    """Items that are tuples, batched by its own collate_fn into a dict."""

    def __getitem__(self, i: int):
        return (torch.tensor(i), torch.tensor(i % 3))

    def collate_fn(self, items):
        return {"x": torch.stack([a for a, _ in items]), "labels": torch.stack([b for _, b in items]), "own": True}


def indexed(n: int = 10) -> Indexed:
    return Indexed(n)


def not_a_dataset(n: int = 3) -> list:
    return list(range(n))


def tuples(n: int = 4) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n))
