"""``free_space_on_full``: room for a save that failed because the local disk is full.

By default a save that does not fit fails (reported at ``wait``/``close``), and so does every
later one: retention deletes old steps only after a commit, and with a full disk nothing commits.
With ``CheckpointManager(..., free_space_on_full=True)``, after a failed save every rank checks
whether its target disk now has less room than the state it saves; if any has, each such disk's
owner (one tier: the coordinator; two tiers: each node's first rank, on its node's directory)
deletes the failed save's partial files, the other incomplete steps and the oldest complete step
beyond the newest one, by retention's rule (none that a step that stays references, each before
the steps it references: :mod:`.step_references`), and every rank tries the save once more. A check of free space, not of
the error's text: DCP hands the ranks each other's errors without their ``OSError`` (and its
``errno``), and "no space" must be told apart the same way on every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

from ..dcp.collectives import Group
from ..errors import CheckpointError
from ..storage.base import Store
from .retention import delete_step, deletion_order, scan_steps, spare_referenced

__all__ = ["free_oldest", "make_room", "short_of_space"]

logger = logging.getLogger("goodput_ckpt.manager")


def short_of_space(store: Store, needed: int) -> bool:
    """Whether the local disk under ``store`` has less free space than ``needed`` bytes (never
    for a store that is not on a local disk: an object store is not full)."""
    path = store.traits.local_path
    while path and not os.path.exists(path):  # a root not made yet: its nearest existing parent
        parent = os.path.dirname(path)
        path = parent if parent != path else None
    if not path:
        return False
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < needed


def free_oldest(store: Store, *, protect: Collection[int] = ()) -> list[int]:
    """Delete every incomplete step under ``store`` and the oldest complete step beyond the
    newest one, except ``protect`` (a step a persist still reads) and what a step that stays
    references; the steps deleted, ascending.

    The same rule as retention (:func:`~.retention.spare_referenced`, then
    :func:`~.retention.deletion_order`): a step goes only when no step that stays references it
    (an incomplete step may be a base whose record was lost while a kept step still reads its
    data files), and each step goes before every step it references, so that a kill between two
    deletions never leaves a complete step whose base is gone.
    """
    scan = scan_steps(store)
    incomplete = [s for s in scan.incomplete if s not in protect]
    older = [s for s in scan.complete[:-1] if s not in protect]
    # With the oldest complete step that no step that stays references (an incremental save's
    # base stays); the incomplete steps only it referenced go with it.
    doomed = None
    for s in older:  # bounded: one try per complete step
        with_it = spare_referenced(store, scan, [*incomplete, s])
        if s in with_it:
            doomed = with_it
            break
    if doomed is None:
        doomed = spare_referenced(store, scan, incomplete)
    for s in deletion_order(store, scan.files, doomed):
        try:
            delete_step(store, s, scan.files[s])
        except CheckpointError as e:
            logger.warning("could not remove the checkpoint of step %d to make room: %s", s, e)
    return sorted(doomed)


def make_room(
    group: Group,
    store: Store,
    *,
    owner_of: dict[int, int],
    step: int,
    needed: int,
    protect: Collection[int] = (),
) -> bool:
    """Every rank, after the save of ``step`` failed: whether some rank's disk is short of space
    (one gather), after making room on each disk short of it (its owner, ``owner_of[rank]``,
    deletes what :func:`free_oldest` names). ``needed``: the bytes this rank saves."""
    flags = group.gather(short_of_space(store, needed))
    if not any(flags):
        return False
    mine = [r for r, f in enumerate(flags) if f and owner_of.get(r) == group.rank]
    if mine:
        freed = free_oldest(store, protect=protect)
        logger.warning(
            "the save of step %d failed: the disk under %s is full; deleted step(s) %s (free_space_on_full) "
            "and trying once more",
            step,
            store.uri,
            ", ".join(map(str, freed)) or "none",
        )
    return True
