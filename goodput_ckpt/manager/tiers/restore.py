"""A two-tier restore: the newest step every rank can rebuild, each file from its nearest intact copy.

All ranks run :func:`restore_tiers` together, over the manager's group:

1. *Inventory.* Every rank lists its node's local directory (steps, which hold a commit record,
   and the data files present with their sizes); the coordinator lists the persistent tier.
   The candidates are the steps with a commit record on some node or complete on the
   persistent tier, newest first (or just the step asked for).
   (:mod:`.candidates`)
2. *One candidate at a time* (:func:`_attempt`): the commit record comes from the first node
   whose record validates, else from the persistent tier (:func:`.candidates.agreed_record`). Each rank plans its load as
   ``dcp.load`` will and so knows which data files, and which hash chunks of them, it reads.
   A file its node's copy lacks, or holds at another size, is named in a warning and taken
   from the next tier: a replica (or any copy) on another node, whose chunks each rank that
   reads it receives over the group and keeps in memory; else the persistent tier, which the
   load reads it from directly (step 3). Neither is written into
   the node's copy, which would cost a write and a read of every byte before the load.
   When some rank cannot get a file from anywhere, every rank moves on to the next candidate
   together: no rank ever restores a different step from the others (:mod:`.mend`; the
   reason is a :class:`.mend.Unrebuildable`).
3. *Load, in one pass.* Each rank now has every file it reads: in its node's copy, in memory
   or on the persistent tier. The target (:class:`~..restoring.RestoreTarget`) reads them
   through ``CheckpointReader``, told where each file is by one ``ReadSources`` value (the
   agreed record already parsed, the files read from elsewhere), which checks each chunk as it reads it: the bytes are read
   and hashed once. Each rank loads on
   its own, in two parts (``state.apply.split_dest``): its per-rank rows, decoded and checked,
   then, once one gather told every rank that every rank's rows are good (and an elastic
   restore shared and checked the old loader states: ``target.decode``), the tensors, read into the
   live model and optimizer; one gather then tells every rank every outcome. When some rank finds a
   damaged chunk, every rank checks all the chunks it reads in its node's copy (so that every
   damaged file is found at once), those files are fetched into the node's copy from the next
   tier (from the persistent tier too this time, checked on arrival), and every rank loads
   again; a step whose damaged files have no intact copy anywhere is passed
   for the next candidate, as in step 2. Last, a node's first rank writes the agreed commit
   record into its node's copy where that copy holds every file its ranks read but held no
   record (or another one). A copy that lacked files is not rebuilt: the next save makes a new
   local step.

Afterwards each node drops its local steps newer than the one restored (a newest-first search
only passes a step that cannot be rebuilt) and incomplete ones.

What one rank does alone between two collectives (list, read a record, make a directory, load)
must not raise out of the restore, whatever it raises: that rank would leave while the others
wait for it in the next collective. Such steps go through :func:`.mend.or_error`, and their failure
travels to every rank on the next collective, which decides for all.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ...dcp.needed_files import chunks_read_by
from ...dcp.read_sources import ReadSources
from ...errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    as_checkpoint_error,
    find_checkpoint_error,
)
from ...format.manifest import MANIFEST_NAME, parse_manifest
from ...format.references import with_references
from ...storage.base import FileOrigin, Store
from ..agreement import raise_first_failure, raise_if_any_rank_failed
from ..job import job_of
from ..restoring import ROWS_PART, TENSORS_PART, Restored, RestoreTarget
from ..retention import apply_retention, delete_step, deletion_order
from ..step_layout import list_step_dirs
from .candidates import agreed_record, list_candidates
from .local_tier import LocalTier
from .mend import LOCAL, PERSISTENT, Candidate, Unrebuildable, check_local, mend, or_error, store_of

__all__ = ["restore_tiers"]

logger = logging.getLogger("goodput_ckpt.tiers")


def restore_tiers(
    tier: LocalTier,
    persistent: Store | None,
    *,
    step: int | None,
    keep_last: int | None,
    verify: bool,
    target: RestoreTarget,
    persistent_options: dict[str, Any] | None = None,
) -> Restored | None:
    """Agree on a step and make every node's copy hold what its ranks read (the module doc).

    Args:
        persistent: the persistent root (``None``: local tier only).
        step: the step asked for, or ``None`` for the newest one that can be rebuilt.
        target: what is restored and how (plan, agreement, the two loads, the decode between).
        persistent_options: the persistent root's backend options.

    Returns:
        What was chosen and loaded into ``target``, or ``None`` when ``step`` is ``None`` and no
        tier holds a step.

    Raises:
        CheckpointError: no candidate can be rebuilt (each one's reason is in the message), or
            the step asked for cannot; or ``target`` refused the step (every rank raises).
    """
    layout = tier.layout
    found = list_candidates(tier, persistent, step, keep_last)
    if found is None:
        return None
    failures: list[Unrebuildable] = []
    for s in found.candidates:
        outcome = _attempt(
            tier, persistent, persistent_options, s, found.nodes, s in found.persisted, verify=verify, target=target
        )
        if isinstance(outcome, Unrebuildable):
            failures.append(outcome)
            if layout.rank == 0:
                logger.warning("cannot restore step %d from any tier: %s", s, outcome.reason)
            continue
        if step is None and layout.rank in layout.ranks_of(layout.node)[:1]:
            _drop_after(tier, s, keep_last)
        return outcome
    raise CheckpointError("no checkpoint can be rebuilt from any tier: " + "; ".join(map(str, failures)))


def _attempt(
    tier: LocalTier,
    persistent: Store | None,
    persistent_options: dict[str, Any] | None,
    s: int,
    nodes: dict[int, dict[int, dict[str, int]]],
    persisted: bool,
    *,
    verify: bool,
    target: RestoreTarget,
) -> Restored | Unrebuildable:
    """Try to rebuild and load ``s`` on every node (module doc, steps 2 and 3): what was
    loaded, or why it cannot be rebuilt (the same answer on every rank)."""
    layout = tier.layout
    here = nodes.get(layout.node, {}).get(s, {})
    data, record_here = agreed_record(tier, persistent, s, MANIFEST_NAME in here, persisted)
    if isinstance(data, Unrebuildable):
        return data
    where = tier.step_uri(s)
    manifest = parse_manifest(data, location=where)
    c = Candidate(tier, persistent, persistent_options, s, manifest, nodes, persisted)
    theirs = or_error(f"reading the job of {where}", lambda: job_of(manifest, where))  # the same on every rank
    if isinstance(theirs, CheckpointError):
        return c.unrebuildable(str(theirs))
    if theirs.id != tier.job.id and not (theirs.id is None and c.persisted):
        # Only the persistent root, the job's home, may hold steps saved before job identities.
        return c.unrebuildable(
            f"its commit record belongs to another job ({theirs.id or 'none recorded'}), not to job {tier.job.id}"
        )
    plan, need, missing, notes, local_err = None, {}, set(), {}, None
    try:
        plan = target.plan(manifest, where)
        need = chunks_read_by(target.dest(plan), manifest)
        # Sizes only: the load itself checks every chunk it reads (one pass over the bytes).
        missing, notes = check_local(c, need, verify=False)
    except Exception as e:  # noqa: BLE001 - DCP's planner raises plain errors; every rank raises
        local_err = as_checkpoint_error(e, f"planning the restore of step {s}")
    raise_if_any_rank_failed(tier.group, local_err, agree=target.agreement(plan))
    assert plan is not None
    # What this node's copy lacks is not written into it first, which would cost a write and a
    # read of every byte before the load (a persistent restore took 2-2.5x a one-tier one):
    # from another node, each rank receives the chunks it reads into memory; files from the
    # persistent tier are read there by the load. The load checks both as it reads them. The
    # node's copy stays without them (and uncommitted); the next save makes a new local step.
    got = mend(c, {n: need[n] for n in missing}, direct=True, why=notes)
    if isinstance(got, Unrebuildable):
        return got
    arrived, node_whole = got.tiers, got.node_whole

    def read_from() -> dict[str, FileOrigin]:
        out: dict[str, FileOrigin] = {}
        if got is not None and got.received is not None:
            out.update(dict.fromkeys(got.received.files, got.received))
        fetched = [name for name, tier_name in arrived.items() if tier_name == PERSISTENT]
        if fetched:
            assert persistent is not None
            at = with_references(store_of(persistent, s, c.persistent_options), manifest)  # bases persisted first
            out.update(dict.fromkeys(fetched, at))
        return out

    def load(part: int, checked: set[str], elsewhere: dict[str, FileOrigin]) -> None:
        sources = ReadSources(partial=True, manifest=manifest, checked_files=frozenset(checked), read_from=elsewhere)
        reader = target.reader(where, sources)
        try:
            # Local: every rank's outcome is gathered right after (_load_checked).
            target.read(part, plan, reader, f"loading {where}", local=True)
        finally:
            reader.read_from = {}  # chunks received into memory are freed now, not when the restore returns

    # Two parts (state/apply.py): the per-rank rows, decoded and checked on every rank, and only
    # then the tensors, read into the live ones, so that a refused restore changes none of them.
    # Nothing arrived checked: the load checks what it reads from memory and from S3.
    repaired = False
    for part in (ROWS_PART, TENSORS_PART):
        if part == TENSORS_PART:
            target.decode(plan)  # raises on every rank alike
        load_part = functools.partial(load, part)
        if repaired:  # every chunk this rank reads was checked in the repair
            _load_checked(load_part, where, set(need), dict, tier, repairable=False)
            continue
        if not _load_checked(load_part, where, set(), read_from, tier):
            continue
        # Some rank read a chunk that does not match the manifest (or a file cut short since
        # the size check). Check every chunk this rank reads, so that every damaged file is
        # found at once, fetch those from the next tier into this node's copy (checked on
        # arrival; a file taken from elsewhere above counts as missing here, so it is fetched
        # too, and a damaged one fails the step as any bad fetch does) and load again, from
        # this node's copy alone.
        got = None  # the chunks received into memory are not read again
        missing, notes = check_local(c, need, verify=verify)
        again = mend(c, {n: need[n] for n in missing}, why=notes)
        if isinstance(again, Unrebuildable):
            return again
        arrived.update(again.tiers)
        node_whole = repaired = True
        # Every chunk this rank reads has now been checked, here or on arrival (when verifying).
        _load_checked(load_part, where, set(need), dict, tier, repairable=False)
    got = None  # the chunks received into memory are freed once loaded
    if layout.rank in layout.ranks_of(layout.node)[:1] and not record_here and node_whole:
        _commit_node_copy(tier, s, data)
    # Where each file this rank reads came from: its node's copy, unless this rank took it from
    # elsewhere (or, after a repair, a rank of its node fetched it into the copy).
    sources: dict[str, int] = {}
    for name in need:
        tier_name = arrived.get(name, LOCAL)
        sources[tier_name] = sources.get(tier_name, 0) + 1
    return Restored(s, where, manifest, plan, sources)


def _load_checked(
    load: Callable[[set[str], dict[str, FileOrigin]], None],
    where: str,
    checked: set[str],
    read_from: Callable[[], dict[str, FileOrigin]],
    tier: LocalTier,
    *,
    repairable: bool = True,
) -> bool:
    """Load from this node's copy (``checked``: files not to hash again; ``read_from()``: the
    files to read from another tier, and its store, opened here so that a failure to open it
    counts as this rank's load failing); ``True`` when ``repairable`` and some rank found a
    damaged or short file (every rank answers the same). Any other failure, and any failure at
    all once the copy was repaired, raises on every rank."""
    err: CheckpointError | None = None
    loaded = or_error(f"loading {where}", lambda: load(checked, read_from()))
    if isinstance(loaded, CheckpointError):
        err = loaded
    found = find_checkpoint_error(err) if err is not None else None
    damaged = repairable and isinstance(found, (CorruptCheckpointError, IncompleteCheckpointError))
    # One gather: whether some rank found damage (then every rank repairs), else any error.
    outcomes = tier.group.gather((damaged, None if err is None else str(err)))
    if any(d for d, _ in outcomes):
        return True
    raise_first_failure(err, [msg for _, msg in outcomes])
    return False


def _commit_node_copy(tier: LocalTier, s: int, data: bytes) -> None:
    """This node's first rank, after the load: its node's copy of ``s`` holds every file its
    ranks read but no commit record of its own (or another one): write the agreed record.

    No rank waits for it (the load was given the parsed record), so a failed write does not
    fail the restore: raising here would fail it on this rank alone. The copy then just stays
    uncommitted, as a warning says.
    """
    layout = tier.layout

    def commit_here() -> None:
        here_store = store_of(tier.store, s)
        here_store.prepare()
        here_store.put_commit_record(MANIFEST_NAME, data, replace=True)

    e = or_error(f"committing node {layout.node}'s copy of step {s}", commit_here)
    if e is not None:
        logger.warning(
            "restore of step %d: node %d's local copy could not be committed (%s); it will not count as a local "
            "checkpoint",
            s,
            layout.node,
            e,
        )


def _drop_after(tier: LocalTier, s: int, keep_last: int | None) -> None:
    """This node's leader, after restoring ``s``: delete local steps newer than ``s`` (none of
    them could be rebuilt) and incomplete or surplus ones (best effort)."""
    try:
        listed = list_step_dirs(tier.store)
        for step in deletion_order(tier.store, listed, [step for step in listed if step > s]):  # referrers first
            delete_step(tier.store, step, listed[step])
        apply_retention(tier.store, committed=s, keep_last=keep_last)
    except Exception as e:  # noqa: BLE001 - best effort, after the last collective
        logger.warning("cleaning %s after the restore failed: %s", tier.uri, e)
