"""The collectives the package makes, over one process group or none: :class:`Group`.

Why one module: the manager's decisions (which step to restore, whether every rank's save or
plan succeeded), the two-tier restore's inventory and records, the local tier's commit, the
shared manifest and an elastic restore's loader states all pair one rank's call with the
others'. Each used to call ``torch.distributed`` itself, behind its own ``pg is None`` check for
a single process. Here the single-process answer is built in: a gather of one rank returns that
rank's value, a broadcast returns the value given, so a caller reads the same with or without a
group, and a new caller cannot forget the check.

Every method is collective: every rank of the group calls it, in the same order (the callers'
docstrings say when). Object collectives pickle what crosses the group; the values are built by
this job (never bytes read from a checkpoint, which cross as ``bytes`` or as tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group"]


class Group:
    """A process group, or ``None`` for one process, with the collectives the package uses.

    Args:
        pg: the group (``None``: one process, or ``torch.distributed`` not initialized; then
            every collective is answered locally).
        world_size: the group's size when known (saves a query); ``None`` asks the group.
    """

    __slots__ = ("pg", "rank", "world_size")

    def __init__(self, pg: Any = None, world_size: int | None = None) -> None:
        self.pg = pg
        if pg is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(pg)
            self.world_size = world_size if world_size is not None else dist.get_world_size(pg)

    @classmethod
    def default(cls, group: Any = None) -> Group:
        """``group``, or the default group, when ``torch.distributed`` is initialized and the
        group has more than one rank; else a single-process :class:`Group`. For a DCP load,
        which runs on the default group unless told otherwise."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
            return cls(None)
        return cls(group if group is not None else dist.group.WORLD)

    @property
    def single(self) -> bool:
        """Whether this is one process (no collective crosses anything)."""
        return self.pg is None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (``all_gather_object``)."""
        if self.pg is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.pg)
        return out

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """``src``'s ``value`` on every rank (``broadcast_object_list``); the others' ``value``
        is ignored."""
        if self.pg is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.pg, group_src=src)
        return box[0]

    def broadcast_bytes(self, flat: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s flat ``uint8`` tensor on every rank, as a CPU tensor: the others pass an
        empty tensor of the same size (known from a manifest, so no size crosses the group).
        The tensor goes where the group's backend takes it (a NCCL group: the current GPU)."""
        if self.pg is None:
            return flat
        device = self.device()
        moved = flat.to(device)
        dist.broadcast(moved, group=self.pg, group_src=src)
        return moved.cpu()

    def device(self) -> torch.device:
        """Where the group's tensor collectives take tensors: CPU for gloo (the manager's own
        group), this process's current GPU for a NCCL group a caller passed in."""
        if self.pg is None:
            return torch.device("cpu")
        backend = str(dist.get_backend(self.pg)).lower()
        if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
