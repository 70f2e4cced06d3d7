"""Cross-rank agreement: the manager's group, and the decisions every rank must share.

Every rank makes every manager call, and DCP's collectives pair one rank's save (or load) with
the others'. So a decision one rank takes alone (which step to restore, whether it can save at
all, whether its plan failed) must reach the others, or they wait in a collective that this
rank never joins, or pair their next save with another step. The functions here make those
decisions on every rank, over the manager's own group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.collectives import Group
from ..errors import OVERWRITE_HINT, CheckpointError, CheckpointExistsError
from ..storage.base import Store
from .retention import clean_before_restore
from .staging.confirmed_writer import ConfirmedWriter

__all__ = [
    "NO_DIST_WARNING",
    "ExistingSteps",
    "agree_on_latest",
    "decide_on_coordinator",
    "deliberate_no_dist",
    "fail_on_every_rank",
    "open_group",
    "raise_first_failure",
    "raise_if_any_rank_failed",
    "union_of_steps",
]


logger = logging.getLogger("goodput_ckpt.manager")

#: torch's warning when ``dcp.save``/``dcp.load`` run with ``no_dist=True``: it assumes a missing
#: process group, while the manager passes ``no_dist`` on purpose (one process, or a two-tier
#: load that gathers every rank's outcome itself).
NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def deliberate_no_dist(no_dist: bool) -> bool:
    """``no_dist``, for a ``dcp.save``/``dcp.load`` the manager runs with it on purpose; when it
    is set, torch's :data:`NO_DIST_WARNING` (which would wrongly tell the user that their
    process group is missing) is silenced first.

    The one place the manager silences it. The filter is process-wide and narrow (that one
    message): ``warnings.catch_warnings`` would scope it, but it swaps the whole filter list
    and back, which is not safe while another thread (an async save's, or the user's) touches
    warnings, and the manager calls this from its save thread too. Calling it again moves the
    filter to the front, so a broader filter a caller added since (``simplefilter("always")``)
    does not bring the warning back.
    """
    if no_dist:
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
    return no_dist


def open_group(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
    """The group a manager checkpoints over, and whether the manager created it (and must
    destroy it): ``process_group`` when given, else a new gloo group over all ranks when
    torch.distributed is initialized (creating it is collective), else none.

    A group of one rank counts as none: every collective over it answers what the rank gave,
    and through gloo each one pickles its value and runs a round trip (a one-rank restore of
    a 240 MiB model and AdamW made 9 of them, plus ``dcp.load``'s plan gather and scatter,
    about a tenth of its time: ``benchmarks/probe_restore_phases.py``). Every rank sees the
    same size, so they all skip the group alike."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) <= 1:
        return None, False
    if process_group is not None:
        return process_group, False
    if dist.is_available() and dist.is_initialized():
        # Async saves run collectives from a background thread; on their own group they
        # never interleave with the training loop's collectives on the default group.
        return dist.new_group(backend="gloo"), True
    return None, False


def fail_on_every_rank(group: Group, uri: str, err: BaseException, storage_options: dict[str, Any]) -> None:
    """This rank cannot save to ``uri`` (``err``) while the other ranks go on into
    ``dcp.save``: join them with a save that fails in DCP's first collective phase, so the
    save fails on every rank (with this rank's error) instead of leaving them waiting for
    this rank, and every rank's next save pairs with the same step. Alone: nothing to do."""
    if group.single:
        return
    try:
        writer = ConfirmedWriter(uri, **storage_options)
        writer.failure = err
        dcp.save({}, storage_writer=writer, process_group=group.pg)
    except (Exception, CheckpointException):
        pass  # the failure it was made for; ``err`` is raised by the caller


def union_of_steps(group: Group, list_steps: Callable[[], list[int]] | None) -> set[int]:
    """Every rank: the union of the committed steps the listing ranks see (``list_steps``, on
    the ranks that list: the coordinator, and with two tiers each node's first rank), so that a
    save of an existing step is refused on every rank alike, before any rank enters ``dcp.save``.
    One gather, at a manager's first save. A listing that fails counts as empty (logged): the
    save then fails in the background, as it would have without this check."""
    mine: list[int] = []
    if list_steps is not None:
        try:
            mine = list_steps()
        except CheckpointError as e:
            logger.warning("could not list the existing steps (a save of one will fail when it commits): %s", e)
    return {s for steps in group.gather(mine) for s in steps or ()}


class ExistingSteps:
    """The committed steps every rank knows of, to refuse a save of one on every rank alike, at
    the call (a background save would fail only at its commit, reported at ``close()``). No
    collective per save: the steps listed at the first save (one gather, :func:`union_of_steps`)
    and those saved since are the same on every rank. A step saved by another process meanwhile
    still fails at its commit."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._seen: set[int] | None = None  # listed at the first save, every rank

    def refuse(
        self, step: int, uri: str, *, list_steps: Callable[[], list[int]] | None, saved: set[int], where: str
    ) -> None:
        """Raise ``CheckpointExistsError`` when ``step`` is committed (``list_steps``: on the
        ranks that list; ``saved``: the steps this manager committed; ``where``: for the message).
        Collective at the first call."""
        if self._seen is None:
            self._seen = union_of_steps(self.group, list_steps)
        if step in self._seen or step in saved:
            raise CheckpointExistsError(
                f"step {step} already has a committed checkpoint ({where}): {OVERWRITE_HINT}, or save another step",
                path=uri,
            )


def agree_on_latest(
    root: Store, group: Group, *, keep_last: int | None, records: dict[int, bytes] | None = None
) -> int | None:
    """The coordinator picks the newest complete step (and applies retention: incomplete steps
    and complete ones beyond ``keep_last`` go); every rank gets its choice, so all ranks load
    the same step. ``records``: on the coordinator, filled with the commit records its clean-up
    read (step -> bytes), which the load of the chosen step takes instead of reading it again.

    Raises:
        CheckpointError: on every rank, when the coordinator could not list the root.
    """

    def decide() -> int | None:
        fresh: list[str] = []
        latest = clean_before_restore(root, keep_last=keep_last, fresh_start=fresh, records=records)
        if fresh:  # a wrong or empty root must not start training from scratch in silence
            logger.warning("restore: %s; training starts from step 0", fresh[0])
        return latest

    return decide_on_coordinator(group, decide, f"listing checkpoints under {root.uri}")


def raise_first_failure(local_err: CheckpointError | None, messages: list[str | None]) -> None:
    """After a gather of every rank's error message (``None``: that rank succeeded): raise this
    rank's own error, else the first other rank's, the same way on every rank."""
    if local_err is not None:
        raise local_err
    for rank, msg in enumerate(messages):
        if msg is not None:
            raise CheckpointError(f"restore failed on rank {rank}: {msg}")


def raise_if_any_rank_failed(
    group: Group,
    local_err: CheckpointError | None,
    *,
    agree: tuple[str, Any] | None = None,
    tell: Any = None,
) -> list[Any]:
    """Raise on every rank when any rank failed to plan, instead of letting the others hang in
    the load's collectives: this rank's own error, else the first other rank's.

    ``agree`` is ``(what, value)``: a decision of this rank's plan that decides which collectives
    it joins next (an elastic restore's loader-state broadcast). It rides on the same gather, so
    checking it costs no collective; ranks whose values differ raise on every rank, naming
    ``what``, instead of one rank waiting in a broadcast the others never join.

    ``tell``: a value of this rank's that may differ between ranks (whether it reads per-rank
    rows), carried by the same gather. Returns every rank's ``tell``, in rank order.
    """
    mine = None if agree is None else agree[1]
    gathered = group.gather((None if local_err is None else str(local_err), mine, tell))
    raise_first_failure(local_err, [msg for msg, _, _ in gathered])
    if agree is not None:
        for rank, (_, value, _) in enumerate(gathered):
            if value != gathered[0][1]:
                raise CheckpointError(
                    f"the ranks disagree on {agree[0]}: rank 0 has {gathered[0][1]!r}, rank {rank} has {value!r}"
                )
    return [told for _, _, told in gathered]


def decide_on_coordinator(group: Group, decide: Any, what: str) -> Any:
    """``decide()`` on the coordinator, its result on every rank (one broadcast).

    Raises:
        CheckpointError: on every rank, when ``decide`` raised a ``CheckpointError`` on the
            coordinator (its message, after ``what``).
    """
    box: list[Any] = [None, None]
    if group.rank == 0:
        try:
            box[0] = decide()
        except CheckpointError as e:
            box[1] = str(e)
    box = group.broadcast(box)
    if box[1] is not None:
        raise CheckpointError(f"{what} failed on the coordinator: {box[1]}")
    return box[0]
