"""Version 2 of the elastic data position: one fixed-size global record per job.

Why one number suffices: ``DistributedSampler`` gives rank ``r`` of ``W`` the items
``perm[r::W]`` of the epoch's permutation, and a synchronous data-parallel step consumes one
batch on every rank, so after ``S`` steps of batch ``b`` the ranks together consumed exactly the
prefix ``perm[:S*W*b]``, whatever ``W`` and ``b`` were. The position is that prefix's length
(``start``), so after a restart on ``W'`` ranks rank ``r`` continues with ``perm[start + r :: W']``,
and the sequence of samples consumed across all ranks continues the one permutation: with the
same global batch (``W*b == W'*b'``) the global batches after a restart are the very batches an
uninterrupted run draws.

The rare uneven cases add a short list of *exceptions* (``taken``): positions past ``start``
consumed already, when the old ranks stopped at different counts (a loop that was not in step).
The list holds at most :data:`MAX_TAKEN` positions; a restore that would need more is refused
(the ranks were that far out of step). A drop_last tail (fewer than ``W`` samples at an epoch's
end) needs none: it is simply not consumed, and stays pending in that epoch.

The record is ``{"epoch", "start", "taken"}``: at most :data:`MAX_RECORD_BYTES` pickled, whatever
the world size, dataset size or number of restarts (tests/data/test_global_position.py). Version
1 (:mod:`.position`: per-world-size segments folded into a bitmap) is still read and converted
by :func:`.migrate.from_v1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._saved import saved_int
from .position import MAX_EPOCH, rank_share

__all__ = ["MAX_RECORD_BYTES", "MAX_TAKEN", "GlobalPosition", "OutOfStepError"]

#: Exceptions a record holds at most: positions past ``start`` consumed by ranks that were ahead.
MAX_TAKEN = 256
#: Bound on a record's pickled size (256 positions of up to 10 bytes, the epoch and start).
MAX_RECORD_BYTES = 4096


class OutOfStepError(ValueError):
    """The consumed samples are not a prefix and at most :data:`MAX_TAKEN` exceptions: the ranks
    were further out of step than a record holds (not a malformed state)."""


@dataclass(frozen=True)
class GlobalPosition:
    """The consumed part of ``epoch``'s permutation: the prefix ``[0, start)`` and the positions
    in ``taken`` (sorted, each past ``start``). A fresh epoch is ``GlobalPosition(epoch)``."""

    epoch: int
    start: int = 0
    taken: tuple[int, ...] = ()

    def pending_count(self, n: int) -> int:
        """Samples of the ``n``-sample epoch not consumed yet."""
        return n - self.start - len(self.taken)

    def _positions(self, j: torch.Tensor) -> torch.Tensor:
        """Permutation positions of the pending list's indices ``j``. The pending list is
        ``[start, n)`` less ``taken``; ``a[i] = taken[i] - start - i`` pending items precede
        ``taken[i]``, so the ``j``-th pending item skips the ``taken`` whose ``a[i] <= j``."""
        if not self.taken:
            return j + self.start
        a = torch.tensor(self.taken, dtype=torch.int64) - self.start - torch.arange(len(self.taken))
        return j + self.start + torch.searchsorted(a, j, right=True)

    def share(self, n: int, world_size: int, rank: int, *, drop_last: bool) -> torch.Tensor:
        """Permutation positions ``rank`` of ``world_size`` reads from here, in order: the pending
        list split as ``DistributedSampler`` splits an epoch (:func:`.position.rank_share`), so
        ``perm[start + rank :: world_size]`` without exceptions. O(the share), not O(n)."""
        return self._positions(rank_share(self.pending_count(n), world_size, rank, drop_last=drop_last))

    def advanced(self, world_size: int, counts: list[int] | tuple[int, ...], n: int) -> GlobalPosition:
        """This position after ``world_size`` ranks consumed ``counts[r]`` of their shares (the
        counts already checked against the share). Equal counts ``c`` move ``start`` by
        ``W * c`` (all of the pending list if padding wrapped); a rank ahead of the slowest adds
        its extra positions to ``taken``.

        Raises:
            ValueError: the counts are not one per rank.
            OutOfStepError: the ranks ahead consumed more than :data:`MAX_TAKEN` positions past
                the common prefix.
        """
        if len(counts) != world_size:
            raise ValueError(f"{world_size} rank(s) need {world_size} counts, got {len(counts)}")
        length = self.pending_count(n)
        if length <= 0 or not counts:
            return self
        low = min(counts)
        extra = sum(c - low for c in counts)  # bounded before anything is enumerated
        if extra + len(self.taken) > MAX_TAKEN:
            raise OutOfStepError(
                f"the ranks stopped {extra} sample(s) apart (counts from {low} to {max(counts)}); a position "
                f"records at most {MAX_TAKEN} samples past the common prefix"
            )
        head = min(world_size * low, length)  # pending indices [0, head) are consumed
        if head == length:
            return GlobalPosition(self.epoch, n)
        js = sorted(
            {j for r, c in enumerate(counts) for k in range(low, c) if (j := (r + world_size * k) % length) >= head}
        )
        first = int(self._positions(torch.tensor([head]))[0])  # the first pending item not in the prefix
        done = {t for t in self.taken if t > first}
        done.update(self._positions(torch.tensor(js, dtype=torch.int64)).tolist() if js else ())
        while first in done:  # bounded by len(done)
            done.discard(first)
            first += 1
        return GlobalPosition(self.epoch, first, tuple(sorted(done)))

    def to_state(self) -> dict:
        """The record: plain ints and a list, what ``torch.load(weights_only=True)`` reads."""
        return {"epoch": self.epoch, "start": self.start, "taken": list(self.taken)}

    @classmethod
    def from_state(cls, state: object, n: int) -> GlobalPosition:
        """Inverse of :meth:`to_state` for an ``n``-sample epoch, each field checked before use:
        ``epoch`` in [0, ``MAX_EPOCH``], ``start`` in [0, ``n``], ``taken`` a list of at most
        :data:`MAX_TAKEN` strictly increasing integers in (``start``, ``n``).

        Raises:
            ValueError: naming the field.
        """
        try:
            if not isinstance(state, dict):
                raise ValueError(f"a dict, got {type(state).__name__}")
            epoch = saved_int(state.get("epoch"), 0, MAX_EPOCH, "epoch")
            start = saved_int(state.get("start"), 0, n, "start")
            raw = state.get("taken")
            if not isinstance(raw, (list, tuple)) or len(raw) > MAX_TAKEN:
                raise ValueError(f"taken must be a list of at most {MAX_TAKEN} positions")
            taken: list[int] = []
            for i, t in enumerate(raw):
                lo = taken[-1] + 1 if taken else start + 1
                taken.append(saved_int(t, lo, n - 1, f"taken[{i}] (increasing, past start {start})"))
        except ValueError as e:
            raise ValueError(f"malformed elastic sampler position: {e}") from None
        return cls(epoch, start, tuple(taken))
