"""Version 1 of the elastic data position (still read: :mod:`.migrate` converts it to version 2,
:mod:`.global_position`), and the permutation and split both versions share.

Why a history instead of one counter: ranks consume their own strided share of the epoch, so
"n samples consumed" only names a set of samples together with the world size that split them.
A position is therefore the epoch plus a short list of *segments*, one per stretch of training
at one world size: ``(world_size, [consumed by rank 0, consumed by rank 1, ...])``. Segment ``k``
split the samples still pending after segments ``0..k-1``, in permutation order, the way
``DistributedSampler`` does (rank ``r`` takes positions ``r, r + W, r + 2W, ...``), and its counts
say how far each rank got. Unequal counts and any number of restarts within one epoch stay
exact, and nothing depends on the worker count or the batch size.

Each restart within an epoch adds a segment of ``world_size`` integers. To bound the size, a
position with more than :data:`MAX_SEGMENTS` segments folds them into ``done``: one bit per
position of the epoch's permutation (``ceil(n / 8)`` bytes), set once consumed.

This module is pure arithmetic on index tensors; :mod:`.sampler` puts it behind a sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.schema import MAX_WORLD_SIZE
from ._saved import saved_int, saved_tensor

__all__ = ["MAX_EPOCH", "MAX_SEGMENTS", "EpochPosition", "epoch_order", "rank_share"]

#: Segments kept before they are folded into the ``done`` bitmap (restarts within one epoch).
MAX_SEGMENTS = 16
#: The largest epoch a saved position may name: ``seed + epoch`` seeds ``torch.manual_seed``,
#: which takes 64 bits, and seeds are below 2^63. Far above any real epoch count.
MAX_EPOCH = 1 << 62
#: Bound on a saved count when the epoch's length is not known.
_MAX_COUNT = 1 << 62

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The epoch's permutation of ``range(n)``: the one ``DistributedSampler`` uses, so every
    rank of every topology agrees on it (``torch.randperm`` seeded with ``seed + epoch``). As
    ``int32`` below 2^31 samples: half the memory (40 MB at 10 M samples), and the same
    permutation (``randperm`` draws the same swaps whatever the dtype)."""
    dtype = torch.int32 if n < 1 << 31 else torch.int64
    if not shuffle:
        return torch.arange(n, dtype=dtype)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g, dtype=dtype)


def rank_share(length: int, world_size: int, rank: int, *, drop_last: bool) -> torch.Tensor:
    """Positions (into a list of ``length`` pending samples) that ``rank`` of ``world_size`` reads.

    As ``DistributedSampler``: with ``drop_last`` every rank gets ``length // world_size`` and the
    tail waits (it stays pending); without, the list is padded by repeating it from its start so
    that every rank gets ``ceil(length / world_size)`` and no rank runs a step fewer than another.
    """
    per = length // world_size if drop_last else -(-length // world_size)
    if per == 0:  # nothing pending, or (drop_last) fewer pending than ranks: an empty share each
        return torch.empty(0, dtype=torch.int64)
    return torch.arange(rank, per * world_size, world_size, dtype=torch.int64) % length


def _pack(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    bits = torch.cat([mask.to(torch.uint8), torch.zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    return (bits * _BITS).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed.view(-1, 1) & _BITS) != 0).view(-1)[:n]


@dataclass(frozen=True)
class EpochPosition:
    """Where the job stands in ``epoch`` (module docstring).

    ``segments`` are ``(world_size, counts)`` pairs; ``done`` is ``None`` or the packed bitmap of
    folded segments. A fresh epoch is ``EpochPosition(epoch)``.
    """

    epoch: int
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    done: torch.Tensor | None = None

    def pending(self, order: torch.Tensor) -> torch.Tensor:
        """The samples of ``order`` (the epoch's permutation) not consumed yet, in order.

        Raises:
            ValueError: a segment names more samples than its ranks could have read.
        """
        alive = torch.arange(order.numel(), dtype=torch.int64)
        if self.done is not None:
            if self.done.numel() * 8 < order.numel():
                raise ValueError(
                    f"the saved position's bitmap covers {self.done.numel() * 8} samples, the epoch has {order.numel()}"
                )
            alive = alive[~_unpack(self.done, order.numel())]
        for ws, counts in self.segments:
            alive = alive[~_consumed(alive.numel(), ws, counts)]
        return order[alive]

    def advanced(self, world_size: int, counts: list[int] | tuple[int, ...], n: int) -> EpochPosition:
        """This position after a segment of ``world_size`` ranks that consumed ``counts`` (folded
        into ``done`` once there are more than :data:`MAX_SEGMENTS` segments)."""
        if len(counts) != world_size:
            raise ValueError(f"a segment of {world_size} rank(s) needs {world_size} counts, got {len(counts)}")
        segs = (*self.segments, (int(world_size), tuple(int(c) for c in counts)))
        out = EpochPosition(self.epoch, segs, self.done)
        if len(segs) <= MAX_SEGMENTS:
            return out
        alive = torch.zeros(n, dtype=torch.bool)
        alive[out.pending(torch.arange(n, dtype=torch.int64))] = True
        return EpochPosition(self.epoch, (), _pack(~alive))

    def to_state(self) -> dict:
        """JSON-like form (lists of ints, a uint8 tensor) that ``torch.load(weights_only=True)`` reads."""
        return {
            "epoch": self.epoch,
            "segments": [[ws, list(c)] for ws, c in self.segments],
            "done": self.done,
        }

    @classmethod
    def from_state(cls, state: dict, n: int | None = None) -> EpochPosition:
        """Inverse of :meth:`to_state`, every value checked before it is used (:mod:`._saved`):
        ``epoch`` an integer in [0, :data:`MAX_EPOCH`], at most :data:`MAX_SEGMENTS` segments of
        a world size in [1, ``MAX_WORLD_SIZE``] and as many counts, each in [0, ``n``], and
        ``done`` a contiguous uint8 tensor of ``ceil(n / 8)`` bytes (not a stride-0 view whose
        few stored bytes stand for gigabytes). ``n``: the epoch's length, when known.

        Raises:
            ValueError: a malformed state, naming the field.
        """
        hi = _MAX_COUNT if n is None else n
        try:
            if not isinstance(state, dict):
                raise ValueError(f"a dict, got {type(state).__name__}")
            epoch = saved_int(state.get("epoch"), 0, MAX_EPOCH, "epoch")
            raw = state.get("segments")
            if not isinstance(raw, (list, tuple)) or len(raw) > MAX_SEGMENTS:
                # to_state never writes more: they are folded into 'done'
                raise ValueError(f"segments must be a list of at most {MAX_SEGMENTS} segments")
            segs = []
            for k, seg in enumerate(raw):
                if not (isinstance(seg, (list, tuple)) and len(seg) == 2 and isinstance(seg[1], (list, tuple))):
                    raise ValueError(f"segment {k} must be [world_size, counts]")
                ws = saved_int(seg[0], 1, MAX_WORLD_SIZE, f"segment {k}'s world size")
                if len(seg[1]) != ws:
                    raise ValueError(f"segment {k} of {ws} rank(s) holds {len(seg[1])} counts")
                segs.append(
                    (ws, tuple(saved_int(c, 0, hi, f"segment {k}'s count of rank {r}") for r, c in enumerate(seg[1])))
                )
            done = state.get("done")
            if done is not None:
                numel = -(-n // 8) if n is not None else done.numel() if isinstance(done, torch.Tensor) else 0
                done = saved_tensor(done, torch.uint8, numel, "the 'done' bitmap")
        except ValueError as e:
            raise ValueError(f"malformed elastic sampler position: {e}") from None
        return cls(epoch, tuple(segs), done)


def _consumed(length: int, world_size: int, counts: tuple[int, ...]) -> torch.Tensor:
    """Mask over ``length`` pending samples of those a segment consumed (padding wraps around,
    so a padded repeat marks its original, which was consumed already)."""
    mask = torch.zeros(length, dtype=torch.bool)
    if length == 0:
        return mask
    per_max = -(-length // world_size)
    for rank, c in enumerate(counts):
        if c > per_max:
            raise ValueError(f"rank {rank} of {world_size} consumed {c} samples of a share of at most {per_max}")
        mask[rank_share(length, world_size, rank, drop_last=False)[:c]] = True
    return mask
