"""A two-tier restore's candidates: which steps some tier holds, newest first, and each one's
commit record, agreed by every rank (steps 1 and 2 of :mod:`.restore`'s module doc).

Every node's first rank lists its node's local directory (steps, and the files present with
their sizes) and the coordinator lists the persistent tier; one gather gives every rank all of
it (:func:`list_candidates`). For one candidate, :func:`agreed_record` then takes the commit
record from the first node whose copy validates, else from the persistent tier.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError
from ...format.commit_record import COMMITTED, read_commit_record
from ...format.manifest import MANIFEST_NAME
from ...storage.base import Store
from ..retention import clean_before_restore, scan_steps
from ..step_layout import list_step_dirs, step_dir_name
from .local_tier import LocalTier
from .mend import Unrebuildable, or_error

__all__ = ["Inventory", "agreed_record", "list_candidates"]

logger = logging.getLogger("goodput_ckpt.tiers")


@dataclass(frozen=True)
class Inventory:
    """What every rank knows before trying a candidate: the candidate steps, newest first; each
    node's local steps (node -> step -> {file: size}); the steps complete on the persistent tier."""

    candidates: list[int]
    nodes: dict[int, dict[int, dict[str, int]]]
    persisted: list[int]


def _inventory(local: Store) -> dict[int, dict[str, int]]:
    """Step -> {file: size} of this node's local directory (the commit record included)."""
    out: dict[int, dict[str, int]] = {}
    for step, names in list_step_dirs(local).items():
        sizes = {}
        for name in names:
            if "/" in name:
                continue
            size = local.size(f"{step_dir_name(step)}/{name}")
            if size is not None:
                sizes[name] = size
        out[step] = sizes
    return out


def list_candidates(
    tier: LocalTier, persistent: Store | None, step: int | None, keep_last: int | None
) -> Inventory | None:
    """Every rank: the candidates (``step`` alone when given), with what each node holds; ``None``
    when ``step`` is ``None`` and no tier holds a step (logged: training starts from scratch).
    The coordinator cleans the persistent tier first (incomplete steps, ``keep_last``).

    Raises:
        CheckpointNotFoundError: no tier holds ``step``.
        CheckpointError: the coordinator could not list the persistent tier.
    """
    layout = tier.layout
    persisted: list[int] = []
    listing_error = None
    fresh: list[str] = []  # what the persistent tier holds when nothing there is complete
    if layout.rank == 0 and persistent is not None:

        def listing() -> list[int]:
            clean_before_restore(persistent, keep_last=keep_last, fresh_start=fresh)
            return scan_steps(persistent).complete

        listed = or_error(f"listing {persistent.uri}", listing)
        if isinstance(listed, CheckpointError):
            listing_error = str(listed)
        else:
            persisted = listed
    mine = None
    if layout.rank in layout.ranks_of(layout.node)[:1]:
        listed_here = or_error(f"listing {tier.uri}", lambda: _inventory(tier.store))
        if isinstance(listed_here, CheckpointError):
            # This node's copies are unusable, not the restore: its ranks take their files
            # from the other tiers, as for a lost node.
            _warn_unusable_tier(layout.node, listed_here)
            listed_here = {}
        mine = listed_here
    # One gather carries both: each node's inventory and the coordinator's persistent listing.
    gathered = tier.group.gather((mine, (persisted, listing_error) if layout.rank == 0 else None))
    persisted, listing_error = gathered[0][1]
    if listing_error is not None:
        raise CheckpointError(f"listing the persistent tier failed on the coordinator: {listing_error}")
    nodes: dict[int, dict[int, dict[str, int]]] = {}
    for rank, (inv, _) in enumerate(gathered):
        if inv is not None:
            nodes[layout.node_of(rank)] = inv
    recorded = {s for inv in nodes.values() for s, files in inv.items() if MANIFEST_NAME in files}
    candidates = sorted(recorded | set(persisted), reverse=True)
    if step is not None:
        if step not in candidates:
            raise CheckpointNotFoundError(
                f"no tier holds a committed checkpoint of step {step} (local: {tier.uri} on each node; "
                f"persistent: {persistent.uri if persistent is not None else 'none'})"
            )
        candidates = [step]
    if not candidates:
        if layout.rank == 0:  # a wrong or empty root must not start training from scratch in silence
            held = fresh[0] if fresh else "no persistent tier"
            logger.warning(
                "restore: %s, and no node's local directory (node 0's: %s) holds a committed step; "
                "training starts from step 0",
                held,
                tier.uri,
            )
        return None
    return Inventory(candidates, nodes, persisted)


def agreed_record(
    tier: LocalTier, persistent: Store | None, s: int, on_record_nodes: bool, persisted: bool
) -> tuple[bytes | Unrebuildable, bool]:
    """The commit record of ``s`` on every rank: from the first node whose copy validates, else
    the persistent tier; or why there is none. And, on a node's first rank, whether its node's
    copy holds that very record (``False`` on the other ranks): only first ranks check, once per
    node. A node holding another valid record of the same step number (a save of ``s`` made
    again after a failure, say) counts as holding none, so its record is rewritten with the
    agreed one instead of staying beside data files that now follow the agreed one."""
    layout = tier.layout
    name = step_dir_name(s)
    mine = None  # the digest of this node's valid record
    if on_record_nodes and layout.rank in layout.ranks_of(layout.node)[:1]:
        checked = or_error(
            f"reading {tier.uri}/{name}/{MANIFEST_NAME}",
            lambda: read_commit_record(tier.store, name, count_files=False),
        )
        if not isinstance(checked, CheckpointError) and checked.status == COMMITTED:
            mine = checked.digest
    digests = tier.group.gather(mine)
    src = next((rank for rank, d in enumerate(digests) if d is not None), None)
    valid = mine is not None and src is not None and mine == digests[src]
    data: Any = None
    if src is not None:
        if layout.rank == src:
            data = or_error(f"reading {name}/{MANIFEST_NAME}", lambda: tier.store.read_small(f"{name}/{MANIFEST_NAME}"))
            data = str(data) if isinstance(data, CheckpointError) else data
        data = tier.group.broadcast(data, src)
        if isinstance(data, bytes):
            return data, valid
        return Unrebuildable(
            s, f"its commit record on node {layout.node_of(src)} could not be read: {data or 'it vanished'}"
        ), valid
    if not persisted or persistent is None:
        return Unrebuildable(s, "no node holds a valid commit record and it was never persisted"), valid
    if layout.rank == 0:

        def persistent_record() -> bytes | str:
            rec = read_commit_record(persistent, name, count_files=False)
            return persistent.read_small(f"{name}/{MANIFEST_NAME}") if rec.status == COMMITTED else rec.message

        data = or_error(f"reading {persistent.uri}/{name}/{MANIFEST_NAME}", persistent_record)
        data = str(data) if isinstance(data, CheckpointError) else data
    data = tier.group.broadcast(data)
    return (
        data if isinstance(data, bytes) else Unrebuildable(s, f"its persistent commit record is unusable: {data}")
    ), valid


def _warn_unusable_tier(node: int, err: CheckpointError) -> None:
    logger.warning("node %d's local tier cannot be read (%s); its ranks use the other tiers", node, err)
