"""Reading version-1 elastic positions (:mod:`.position`) as version-2 records (:mod:`.global_position`).

Why a conversion and not two code paths: a version-1 position names a set of consumed positions
of the epoch's permutation (a history of segments or a bitmap); version 2 names the same set as
a prefix and a few exceptions. Every version-1 position a job in step wrote is a prefix (equal
counts consume the first ``W * c`` pending samples), so the conversion is exact; one that is not
a prefix with at most ``MAX_TAKEN`` exceptions (ranks far out of step) is refused. It costs
O(the epoch's length) once per restore, as reading version 1 always did.
"""

from __future__ import annotations

import torch

from .global_position import MAX_TAKEN, GlobalPosition, OutOfStepError
from .position import EpochPosition

__all__ = ["from_v1"]


def from_v1(pos: EpochPosition, n: int) -> GlobalPosition:
    """The version-2 record of the version-1 position ``pos`` of an ``n``-sample epoch.

    Raises:
        ValueError: the position is inconsistent (a count past its share, a short bitmap).
        OutOfStepError: more than ``MAX_TAKEN`` of its consumed samples lie past its first
            pending one.
    """
    if not pos.segments and pos.done is None:
        return GlobalPosition(pos.epoch)
    alive = pos.pending(torch.arange(n, dtype=torch.int64))  # positions still pending, ascending
    if alive.numel() == 0:
        return GlobalPosition(pos.epoch, n)
    start = int(alive[0])
    extra = (n - start) - alive.numel()
    if extra > MAX_TAKEN:
        raise OutOfStepError(
            f"the version-1 position has {extra} consumed sample(s) past its first pending one ({start}); "
            f"version 2 records at most {MAX_TAKEN}"
        )
    mask = torch.ones(n - start, dtype=torch.bool)
    mask[alive - start] = False
    taken = (torch.nonzero(mask).view(-1) + start).tolist()
    return GlobalPosition(pos.epoch, start, tuple(taken))
