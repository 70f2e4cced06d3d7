"""Per-sample randomness that is resumable and independent of the topology.

Why: a ``StatefulDataLoader`` reseeds its workers when it resumes, and which worker (or rank)
draws a sample depends on the worker count and the world size. Augmentation that draws from a
worker's global RNG therefore differs after a resume or a topology change, while every saved
state matches. A generator derived from ``(seed, epoch, sample index)`` alone gives a sample the
same augmentation whichever rank or worker reads it, and whenever.
"""

from __future__ import annotations

import hashlib
import struct

import torch

__all__ = ["sample_generator", "sample_seed"]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends on ``(seed, epoch, index)`` only (blake2b of the three,
    so that neighbouring indices or epochs give unrelated streams)."""
    raw = struct.pack("<qqq", int(seed), int(epoch), int(index))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"goodput-sample").digest(), "little") >> 1


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` for one sample of one epoch; draw its augmentation from it.

    Example, in a map-style dataset whose ``epoch`` attribute the training loop sets before each
    ``iter(loader)`` (workers receive a copy of the dataset when an iterator starts; with
    ``persistent_workers=True`` they do not, so pass the epoch another way)::

        def __getitem__(self, i):
            g = sample_generator(self.seed, self.epoch, i)
            return augment(self.items[i], generator=g)
    """
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, epoch, index))
    return g
