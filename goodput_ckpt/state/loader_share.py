"""An elastic restore's old loader states: read once by the coordinator, sent to the other ranks.

Why: every new rank needs every old rank's (small) dataloader blob to rebuild a global data
position (``state.bundle``). Read by every rank, that is W_old x W_new small requests, about a
million at 1,000 ranks on S3. So only the coordinator (rank 0 of the checkpoint group) puts
them in its DCP destination, and after ``dcp.load`` it broadcasts their raw bytes to the group
as one ``uint8`` tensor: one collective, and nothing is pickled or unpickled on the way.

Every rank knows the blobs' sizes from the manifest it has already validated (its plan holds an
empty ``uint8[old ranks, width]`` tensor of ``dataloader.rows``, or in schema 1 one empty tensor
per old rank), so the receivers allocate exactly what the coordinator read and no size crosses
the wire. The received bytes are then decoded like read ones (``torch.load(weights_only=True)``)
in ``decode_restore``, before any live tensor is read into.

Call order, every rank of the group: ``plan_restore`` -> the ranks agree on the plan's
:func:`share_key` (a mismatch would leave some ranks waiting in this broadcast) -> ``dcp.load``
of the per-rank rows (``apply.split_dest``) -> :func:`share_loader_states` -> ``decode_restore``
-> ``dcp.load`` of the rest -> ``apply_restore``.
"""

from __future__ import annotations

import torch

from ..dcp.collectives import Group
from .bundle import RestorePlan

__all__ = ["share_key", "share_loader_states"]


def share_key(plan: RestorePlan | None) -> tuple[int, int] | None:
    """What every rank's plan must agree on before :func:`share_loader_states`: the number of
    old loader states and their total bytes ((0, 0) when there is nothing to share)."""
    if plan is None:
        return None
    return plan.elastic_from, sum(_bytes(b).numel() for b in plan.elastic_blobs.values())


def share_loader_states(plan: RestorePlan, group: Group) -> None:
    """Give every rank the old loader blobs the coordinator read (a no-op when the restore is not
    elastic, or in one process: then this process read them itself).

    Collective over ``group`` when ``plan.elastic_from``; every rank's :func:`share_key` must be equal.
    """
    if not plan.elastic_from or group.single:
        return
    blobs = [_bytes(b) for b in plan.elastic_blobs.values()]
    total = sum(b.numel() for b in blobs)
    flat = torch.cat(blobs) if plan.elastic_reads else torch.empty(total, dtype=torch.uint8)
    flat = group.broadcast_bytes(flat)
    if plan.elastic_reads:
        return
    start = 0
    for b in blobs:
        b.copy_(flat[start : start + b.numel()])
        start += b.numel()


def _bytes(blob: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a blob template (a view: filling it fills the template)."""
    return blob.reshape(-1).view(torch.uint8)
