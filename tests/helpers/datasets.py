"""Tiny map-style datasets for the sampler and loader tests."""

from __future__ import annotations

from torch.utils.data import Dataset

__all__ = ["Ids"]


class Ids(Dataset):
    """Sample ``i`` is the integer ``i``: what a loader yields names the samples it read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i
