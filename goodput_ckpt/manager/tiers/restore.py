"""A two-tier restore: the newest step every rank can rebuild, each file from its nearest intact copy.

All ranks run :func:`restore_tiers` together, over the manager's group:

1. *Inventory.* Every rank lists its node's local directory (steps, which hold a commit record,
   and the data files present with their sizes); the coordinator lists the persistent tier.
   The candidates are the steps with a commit record on some node or complete on the
   persistent tier, newest first (or just the step asked for).
2. *One candidate at a time* (:func:`_attempt`): the commit record comes from the first node
   whose record validates, else from the persistent tier. Each rank plans its load as
   ``dcp.load`` will and so knows which data files, and which hash chunks of them, it reads.
   A file its node's copy lacks, or holds at another size, is named in a warning and taken
   from the next tier: a replica (or any copy) on another node, whose chunks each rank that
   reads it receives over the group and keeps in memory; else the persistent tier, which the
   load reads it from directly (step 3). Neither is written into
   the node's copy, which would cost a write and a read of every byte before the load.
   When some rank cannot get a file from anywhere, every rank moves on to the next candidate
   together: no rank ever restores a different step from the others.
3. *Load, in one pass.* Each rank now has every file it reads: in its node's copy, in memory
   or on the persistent tier. ``load`` reads them through ``CheckpointReader``, given the
   agreed record already parsed, which checks each chunk as it reads it: the bytes are read
   and hashed once. Each rank loads on
   its own, in two parts (``state.apply.split_dest``): its per-rank rows, decoded and checked,
   then, once one gather told every rank that every rank's rows are good (and an elastic
   restore shared and checked the old loader states: ``decode``), the tensors, read into the
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
wait for it in the next collective. Such steps go through :func:`_or_error`, and their failure
travels to every rank on the next collective, which decides for all.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from ...dcp.needed_files import chunks_read_by
from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    as_checkpoint_error,
    find_checkpoint_error,
)
from ...format.commit_record import COMMITTED, KeyIndex, read_commit_record
from ...format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ...storage import open_store
from ...storage.base import FileOrigin, Store
from ..job import job_of
from ..retention import apply_retention, clean_before_restore, delete_step, scan_steps
from ..step_layout import child_uri, list_step_dirs, step_dir_name
from ..agreement import raise_first_failure, raise_if_any_rank_failed
from .file_moves import Move, ReceivedFiles, check_file, copy_file, run_moves
from .local_tier import LocalTier

__all__ = ["TierRestore", "restore_tiers"]

logger = logging.getLogger("goodput_ckpt.tiers")

LOCAL, REPLICA, PERSISTENT = "local", "replica", "persistent"


@dataclass
class _Arrivals:
    """What :func:`_mend` got: file -> the tier it came from, for this rank (``direct``) or for
    any rank of its node; the files received into memory (``direct``); and whether the node's
    copy now holds every file its ranks read."""

    tiers: dict[str, str]
    received: ReceivedFiles | None = None
    node_whole: bool = True


@dataclass
class TierRestore:
    """What a two-tier restore chose: the step, its manifest, and where this rank's files came from."""

    step: int
    manifest: Manifest
    sources: dict[str, int] = field(default_factory=dict)  # tier -> data files this rank read from it


_T = TypeVar("_T")


def _or_error(what: str, fn: Callable[[], _T]) -> _T | CheckpointError:
    """``fn()``, or why it failed (any exception, as a :class:`CheckpointError` saying ``what``
    failed): for what one rank does alone before a collective it must still join (module doc)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a store may raise OSError and friends, not only ours
        return as_checkpoint_error(e, what)


def _gather(pg: dist.ProcessGroup | None, world_size: int, value: Any) -> list[Any]:
    if pg is None:
        return [value]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=pg)
    return out


def _broadcast(pg: dist.ProcessGroup | None, value: Any, src: int) -> Any:
    if pg is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=pg, group_src=src)
    return box[0]


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


def restore_tiers(
    tier: LocalTier,
    persistent: Store | None,
    *,
    step: int | None,
    keep_last: int | None,
    verify: bool,
    plan_for: Callable[[Manifest, str], Any],
    dest_of: Callable[[Any], dict[str, Any]],
    load: Callable[[int, Any, str, set[str], Manifest, dict[str, FileOrigin]], None],
    decode: Callable[[Any], None],
    agree_of: Callable[[Any], tuple[str, Any]] | None = None,
    persistent_options: dict[str, Any] | None = None,
) -> tuple[TierRestore, Any] | None:
    """Agree on a step and make every node's copy hold what its ranks read (the module doc).

    Args:
        persistent: the persistent root (``None``: local tier only).
        step: the step asked for, or ``None`` for the newest one that can be rebuilt.
        persistent_options: the persistent root's backend options.
        plan_for: ``plan_for(manifest, where)``: this rank's restore plan (may raise; every rank
            then raises).
        dest_of: the DCP destination state dict of a plan.
        load: ``load(part, plan, where, checked, manifest, read_from)``: load part ``part`` of
            this rank's ``plan`` (0: its per-rank rows, decoded and checked as far as this rank
            can alone, 1: the rest, :func:`.state.split_dest`) from the checkpoint location ``where`` (this node's copy, whose commit record is
            ``manifest``), but the files of ``read_from`` from where it maps them (the
            persistent tier's copy of the step, or the chunks received from another node),
            checking every chunk read when verifying and always in the files of ``read_from``,
            except in the files of ``checked`` (after a repair: every chunk this rank reads was
            just checked); raises :class:`CheckpointError`. Every rank calls it at
            the same point, and every rank's outcome is gathered right after, so it need not
            be collective. Part 1 is loaded only once ``decode`` returned.
        decode: ``decode(plan)``, every rank, once part 0 is loaded on every rank: decode and
            check what needs the other ranks (an elastic restore's shared loader states),
            raising on every rank alike when some rank's is bad (collective when it does
            anything); the restore is then refused before any live tensor is read into.
        agree_of: what every rank's plan must agree on (``agreement.raise_if_any_rank_failed``).

    Returns:
        ``(choice, plan)`` with ``plan`` loaded, or ``None`` when ``step`` is ``None`` and no
        tier holds a step.

    Raises:
        CheckpointError: no candidate can be rebuilt (each one's reason is in the message), or
            the step asked for cannot.
    """
    layout, pg = tier.layout, tier.pg
    persisted: list[int] = []
    listing_error = None
    fresh: list[str] = []  # what the persistent tier holds when nothing there is complete
    if layout.rank == 0 and persistent is not None:

        def listing() -> list[int]:
            clean_before_restore(persistent, keep_last=keep_last, fresh_start=fresh)
            return scan_steps(persistent).complete

        listed = _or_error(f"listing {persistent.uri}", listing)
        if isinstance(listed, CheckpointError):
            listing_error = str(listed)
        else:
            persisted = listed
    mine = None
    if layout.rank in layout.ranks_of(layout.node)[:1]:
        listed_here = _or_error(f"listing {tier.uri}", lambda: _inventory(tier.store))
        if isinstance(listed_here, CheckpointError):
            # This node's copies are unusable, not the restore: its ranks take their files
            # from the other tiers, as for a lost node.
            _warn_unusable_tier(layout.node, listed_here)
            listed_here = {}
        mine = listed_here
    # One gather carries both: each node's inventory and the coordinator's persistent listing.
    gathered = _gather(pg, layout.world_size, (mine, (persisted, listing_error) if layout.rank == 0 else None))
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
                "training starts from step 0", held, tier.uri,
            )  # fmt: skip
        return None
    reasons = []
    for s in candidates:
        outcome = _attempt(
            tier, persistent, s, nodes, s in persisted, verify=verify, plan_for=plan_for, dest_of=dest_of, load=load, decode=decode,
            agree_of=agree_of, persistent_options=persistent_options,
        )  # fmt: skip
        if isinstance(outcome, str):
            reasons.append(f"step {s}: {outcome}")
            if layout.rank == 0:
                logger.warning("cannot restore step %d from any tier: %s", s, outcome)
            continue
        if step is None and layout.rank in layout.ranks_of(layout.node)[:1]:
            _drop_after(tier, s, keep_last)
        return outcome
    raise CheckpointError("no checkpoint can be rebuilt from any tier: " + "; ".join(reasons))


def _record(tier: LocalTier, persistent: Store | None, s: int, on_record_nodes: bool, persisted: bool) -> tuple[bytes | str, bool]:
    """The commit record of ``s`` on every rank: from the first node whose copy validates, else
    the persistent tier; or why there is none. And, on a node's first rank, whether its node's
    copy holds that very record (``False`` on the other ranks): only first ranks check, once per
    node. A node holding another valid record of the same step number (a save of ``s`` made
    again after a failure, say) counts as holding none, so its record is rewritten with the
    agreed one instead of staying beside data files that now follow the agreed one."""
    layout, pg = tier.layout, tier.pg
    name = step_dir_name(s)
    mine = None  # the digest of this node's valid record
    if on_record_nodes and layout.rank in layout.ranks_of(layout.node)[:1]:
        checked = _or_error(
            f"reading {tier.uri}/{name}/{MANIFEST_NAME}", lambda: read_commit_record(tier.store, name, count_files=False)
        )  # fmt: skip
        if not isinstance(checked, CheckpointError) and checked.status == COMMITTED:
            mine = checked.digest
    digests = _gather(pg, layout.world_size, mine)
    src = next((rank for rank, d in enumerate(digests) if d is not None), None)
    valid = mine is not None and src is not None and mine == digests[src]
    data: Any = None
    if src is not None:
        if layout.rank == src:
            data = _or_error(f"reading {name}/{MANIFEST_NAME}", lambda: tier.store.read_small(f"{name}/{MANIFEST_NAME}"))
            data = str(data) if isinstance(data, CheckpointError) else data
        data = _broadcast(pg, data, src)
        if isinstance(data, bytes):
            return data, valid
        return f"its commit record on node {layout.node_of(src)} could not be read: {data or 'it vanished'}", valid
    if not persisted or persistent is None:
        return "no node holds a valid commit record and it was never persisted", valid
    if layout.rank == 0:

        def persistent_record() -> bytes | str:
            rec = read_commit_record(persistent, name, count_files=False)
            return persistent.read_small(f"{name}/{MANIFEST_NAME}") if rec.status == COMMITTED else rec.message

        data = _or_error(f"reading {persistent.uri}/{name}/{MANIFEST_NAME}", persistent_record)
        data = str(data) if isinstance(data, CheckpointError) else data
    data = _broadcast(pg, data, 0)
    return (data if isinstance(data, bytes) else f"its persistent commit record is unusable: {data}"), valid


def _check_local(
    store: Store, s: int, manifest: Manifest, files: dict[str, set[int]], verify: bool
) -> tuple[set[str], dict[str, str]]:
    """The files of ``files`` this node's copy of ``s`` lacks, or holds with a damaged chunk
    among those this rank reads (``files``: name -> chunk indices), and why, where it is not
    simply absent (name -> a short reason, for :func:`_report_arrivals`)."""
    step_store = store_of(store, s)
    missing: set[str] = set()
    notes: dict[str, str] = {}
    keys = KeyIndex(manifest)
    for name in sorted(files):
        entry = manifest.files[name]
        size = step_store.size(name)
        if size != entry.size:
            missing.add(name)
            if size is not None:
                notes[name] = f"is {size} bytes, the manifest records {entry.size}"
            continue
        if verify:
            try:
                check_file(step_store, entry, manifest.chunk_size, only=files[name], keys=keys)
            except CheckpointError as e:
                missing.add(name)
                notes[name] = _damage(e)
    return missing, notes


def _damage(err: CheckpointError) -> str:
    """A short reason for a damaged or unreadable file, from the error's fields (byte range and
    keys) rather than its message, whose advice ("restore an earlier checkpoint or a replica")
    the restore is already following."""
    found = find_checkpoint_error(err) or err
    if isinstance(found, CorruptCheckpointError) and found.byte_range is not None:
        keys = found.key or "padding only"
        keys = keys if len(keys) <= 160 else keys[:157] + "..."
        return f"is damaged (bytes [{found.byte_range[0]}, {found.byte_range[1]}), keys: {keys})"
    text = str(found)
    return f"cannot be read ({text if len(text) <= 200 else text[:197] + '...'})"


def store_of(root: Store, s: int, options: dict[str, Any] | None = None) -> Store:
    """The checkpoint location of step ``s`` under ``root`` (``options``: the root's backend
    options, such as an S3 ``endpoint_url``)."""
    return open_store(child_uri(root.uri, step_dir_name(s)), options or {})


def _attempt(
    tier: LocalTier,
    persistent: Store | None,
    s: int,
    nodes: dict[int, dict[int, dict[str, int]]],
    persisted: bool,
    *,
    verify: bool,
    plan_for: Callable[[Manifest, str], Any],
    dest_of: Callable[[Any], dict[str, Any]],
    load: Callable[[int, Any, str, set[str], Manifest, dict[str, FileOrigin]], None],
    decode: Callable[[Any], None],
    agree_of: Callable[[Any], tuple[str, Any]] | None = None,
    persistent_options: dict[str, Any] | None = None,
) -> tuple[TierRestore, Any] | str:
    """Try to rebuild and load ``s`` on every node (module doc, steps 2 and 3): the choice and
    this rank's plan, or why ``s`` cannot be rebuilt (the same answer on every rank)."""
    layout, pg = tier.layout, tier.pg
    here = nodes.get(layout.node, {}).get(s, {})
    data, record_here = _record(tier, persistent, s, MANIFEST_NAME in here, persisted)
    if isinstance(data, str):
        return data
    where = tier.step_uri(s)
    manifest = parse_manifest(data, location=where)
    theirs = _or_error(f"reading the job of {where}", lambda: job_of(manifest, where))  # the same on every rank
    if isinstance(theirs, CheckpointError):
        return str(theirs)
    if theirs.id != tier.job.id and not (theirs.id is None and persisted):
        # Only the persistent root, the job's home, may hold steps saved before job identities.
        return f"its commit record belongs to another job ({theirs.id or 'none recorded'}), not to job {tier.job.id}"
    plan, need, missing, notes, local_err = None, {}, set(), {}, None
    try:
        plan = plan_for(manifest, where)
        need = chunks_read_by(dest_of(plan), manifest)
        # Sizes only: the load itself checks every chunk it reads (one pass over the bytes).
        missing, notes = _check_local(tier.store, s, manifest, need, verify=False)
    except Exception as e:  # noqa: BLE001 - DCP's planner raises plain errors; every rank raises
        local_err = as_checkpoint_error(e, f"planning the restore of step {s}")
    agree = None if agree_of is None or plan is None else agree_of(plan)
    raise_if_any_rank_failed(pg, layout.world_size, local_err, agree=agree)
    # What this node's copy lacks is not written into it first, which would cost a write and a
    # read of every byte before the load (a persistent restore took 2-2.5x a one-tier one):
    # from another node, each rank receives the chunks it reads into memory; files from the
    # persistent tier are read there by the load. The load checks both as it reads them. The
    # node's copy stays without them (and uncommitted); the next save makes a new local step.
    got = _mend(
        tier, persistent, s, manifest, nodes, {n: need[n] for n in missing}, persisted, persistent_options, direct=True,
        why=notes,
    )  # fmt: skip
    if isinstance(got, str):
        return got
    arrived, node_whole = got.tiers, got.node_whole

    def read_from() -> dict[str, FileOrigin]:
        out: dict[str, FileOrigin] = {}
        if got.received is not None:
            out.update(dict.fromkeys(got.received.files, got.received))
        fetched = [name for name, tier_name in arrived.items() if tier_name == PERSISTENT]
        if fetched:
            assert persistent is not None
            out.update(dict.fromkeys(fetched, store_of(persistent, s, persistent_options)))
        return out

    # Two parts (state/apply.py): the per-rank rows, decoded and checked on every rank, and only
    # then the tensors, read into the live ones, so that a refused restore changes none of them.
    # Nothing arrived checked: the load checks what it reads from memory and from S3.
    repaired = False
    for part in (0, 1):
        if part == 1:
            decode(plan)  # raises on every rank alike
        load_part = functools.partial(load, part)
        if repaired:  # every chunk this rank reads was checked in the repair
            _load_checked(load_part, plan, where, set(need), manifest, dict, pg, layout.world_size, repairable=False)
            continue
        if not _load_checked(load_part, plan, where, set(), manifest, read_from, pg, layout.world_size):
            continue
        # Some rank read a chunk that does not match the manifest (or a file cut short since
        # the size check). Check every chunk this rank reads, so that every damaged file is
        # found at once, fetch those from the next tier into this node's copy (checked on
        # arrival; a file taken from elsewhere above counts as missing here, so it is fetched
        # too, and a damaged one fails the step as any bad fetch does) and load again, from
        # this node's copy alone.
        got = None  # the chunks received into memory are not read again
        missing, notes = _check_local(tier.store, s, manifest, need, verify=verify)
        again = _mend(
            tier, persistent, s, manifest, nodes, {n: need[n] for n in missing}, persisted, persistent_options, why=notes,
        )  # fmt: skip
        if isinstance(again, str):
            return again
        arrived.update(again.tiers)
        node_whole = repaired = True
        # Every chunk this rank reads has now been checked, here or on arrival (when verifying).
        _load_checked(load_part, plan, where, set(need), manifest, dict, pg, layout.world_size, repairable=False)
    got = None  # the chunks received into memory are freed once loaded
    if layout.rank in layout.ranks_of(layout.node)[:1] and not record_here and node_whole:
        _commit_node_copy(tier, s, data)
    # Where each file this rank reads came from: its node's copy, unless this rank took it from
    # elsewhere (or, after a repair, a rank of its node fetched it into the copy).
    sources: dict[str, int] = {}
    for name in need:
        tier_name = arrived.get(name, LOCAL)
        sources[tier_name] = sources.get(tier_name, 0) + 1
    return TierRestore(s, manifest, sources), plan


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

    e = _or_error(f"committing node {layout.node}'s copy of step {s}", commit_here)
    if e is not None:
        logger.warning(
            "restore of step %d: node %d's local copy could not be committed (%s); it will not count as a local "
            "checkpoint", s, layout.node, e,
        )  # fmt: skip


def _warn_unusable_tier(node: int, err: CheckpointError) -> None:
    logger.warning("node %d's local tier cannot be read (%s); its ranks use the other tiers", node, err)


#: How :func:`_report_arrivals` names the tier a file was read from.
_FROM = {REPLICA: "another node's replica", PERSISTENT: "the persistent tier"}


def _report_arrivals(
    tier: LocalTier, s: int, nodes: dict[int, dict[int, dict[str, int]]], why: list[dict[str, str]],
    node_arrivals: dict[str, str],
) -> None:  # fmt: skip
    """A node's first rank, once its ranks got every file they read that its copy of ``s``
    lacks or holds damaged (``node_arrivals``: file -> the tier it came from): one warning for a
    node that holds no copy of ``s`` at all (a lost node), else one per file, with why
    (``why``: every rank's reasons). Only the facts: the restore already did what can be done."""
    layout = tier.layout
    if not node_arrivals or layout.rank not in layout.ranks_of(layout.node)[:1]:
        return
    if s not in nodes.get(layout.node, {}):
        used = " and ".join(_FROM[t] for t in sorted(set(node_arrivals.values())))
        logger.warning(
            "restore of step %d: node %d holds no copy of it (%s); its ranks read %d file(s) from %s",
            s, layout.node, tier.uri, len(node_arrivals), used,
        )  # fmt: skip
        return
    reasons = {n: r for rank, w in enumerate(why) if layout.node_of(rank) == layout.node for n, r in w.items()}
    for name in sorted(node_arrivals):
        logger.warning(
            "restore of step %d: node %d's copy of %s %s; read from %s",
            s, layout.node, name, reasons.get(name, "is missing"), _FROM[node_arrivals[name]],
        )  # fmt: skip


def _load_checked(
    load: Callable[[Any, str, set[str], Manifest, dict[str, FileOrigin]], None],
    plan: Any,
    where: str,
    checked: set[str],
    manifest: Manifest,
    read_from: Callable[[], dict[str, FileOrigin]],
    pg: dist.ProcessGroup | None,
    world_size: int,
    *,
    repairable: bool = True,
) -> bool:
    """Load ``plan`` from this node's copy (``checked``: files not to hash again; ``read_from()``:
    the files to read from another tier, and its store, opened here so that a failure to open
    it counts as this rank's load failing); ``True`` when ``repairable`` and some rank found a
    damaged or short file (every rank answers the same). Any other failure, and any failure at
    all once the copy was repaired, raises on every rank."""
    err: CheckpointError | None = None
    loaded = _or_error(f"loading {where}", lambda: load(plan, where, checked, manifest, read_from()))
    if isinstance(loaded, CheckpointError):
        err = loaded
    found = find_checkpoint_error(err) if err is not None else None
    damaged = repairable and isinstance(found, (CorruptCheckpointError, IncompleteCheckpointError))
    # One gather: whether some rank found damage (then every rank repairs), else any error.
    outcomes = _gather(pg, world_size, (damaged, None if err is None else str(err)))
    if any(d for d, _ in outcomes):
        return True
    raise_first_failure(err, [msg for _, msg in outcomes])
    return False


def _mend(
    tier: LocalTier,
    persistent: Store | None,
    s: int,
    manifest: Manifest,
    nodes: dict[int, dict[int, dict[str, int]]],
    missing: dict[str, set[int]],
    persisted: bool,
    persistent_options: dict[str, Any] | None,
    *,
    direct: bool = False,
    why: dict[str, str] | None = None,
) -> _Arrivals | str:
    """Fetch the files of ``missing`` (those this rank reads that its node's copy lacks or holds
    damaged, with the hash chunks it reads of each) into its node's copy: from another node's copy over the group, else the persistent
    tier, each checked on arrival. Collective. Returns what arrived from which tier to this
    rank's node, by any of its ranks, or why ``s`` cannot be rebuilt (the same answer on every
    rank).

    ``direct``: nothing is written into the node's copy. Each rank gets what it reads itself:
    from another node, the chunks it reads, into memory (:attr:`_Arrivals.received`); from the
    persistent tier, nothing yet (the files count as arrived from it, and the load reads them
    there). The load checks both as it reads them. The arrivals are then this rank's own.

    ``why``: why this rank's node lacks some of them (:func:`_check_local`), for the warnings.
    """
    layout, pg = tier.layout, tier.pg
    gathered = _gather(pg, layout.world_size, ({name: sorted(missing[name]) for name in sorted(missing)}, why or {}))
    reports, whys = [r for r, _ in gathered], [w for _, w in gathered]
    if not any(reports):
        return _Arrivals({})  # nothing to fetch anywhere: no second gather
    plan_moves, fetch, why = _route(tier, manifest, s, nodes, reports, persisted, per_rank=direct)
    if why is not None:
        return why
    failed: dict[str, CheckpointError] = {}
    here_store = store_of(tier.store, s)
    keys = KeyIndex(manifest)
    sender_uri = f"the local copy of step {s} on the node of rank {{rank}}"
    received = ReceivedFiles(f"step {s} as received over the process group", manifest.chunk_size) if direct else None
    made = None
    if not direct and (any(m.dst == layout.rank for m in plan_moves) or fetch.get(layout.rank)):
        # A lost node's directory is made again. If it cannot be, this rank still takes part
        # in the moves (it may send too; what it receives fails to land) and fetches nothing.
        made = _or_error(f"making {here_store.uri}", here_store.prepare)
    if plan_moves and pg is not None:
        failed = run_moves(
            plan_moves, rank=layout.rank, store=here_store, chunk_size=manifest.chunk_size, pg=pg,
            sender_uri=sender_uri, keys=keys, into=received,
        )  # fmt: skip
    arrived = {m.name: REPLICA for m in plan_moves if m.dst == layout.rank and m.name not in failed}
    for name, err in failed.items():
        logger.warning("restore of step %d: the replica of %s %s; using the next tier", s, name, _damage(err))
    want = sorted(set(fetch.get(layout.rank, [])) | set(failed))
    errors = []
    if want and not persisted:
        name, first = next(iter(failed.items()))
        errors.append(
            f"{len(failed)} file(s) could not be received from another node and step {s} was never persisted; "
            f"first, {name}: {first}"
        )
    elif want and direct:
        arrived.update(dict.fromkeys(want, PERSISTENT))
    elif isinstance(made, CheckpointError):
        errors.append(str(made))
    elif want:
        assert persistent is not None
        src = _or_error(f"opening {persistent.uri}", lambda: store_of(persistent, s, persistent_options))
        for name in want:
            got = src if isinstance(src, CheckpointError) else _or_error(
                f"copying {name} of step {s} from {persistent.uri}",
                lambda n=name: copy_file(src, here_store, manifest.files[n], manifest.chunk_size, keys=keys),
            )  # fmt: skip
            if isinstance(got, CheckpointError):
                errors.append(f"{name} from the persistent tier: {got}")
            else:
                arrived[name] = PERSISTENT
    outcomes = _gather(pg, layout.world_size, (errors[0] if errors else None, arrived))
    bad = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if bad:
        return f"rank {bad[0][0]} could not get its files: {bad[0][1]}"
    # One gather carries both: what arrived on this rank's node, by any of its ranks.
    node = {n: t for r, (_, got) in enumerate(outcomes) if layout.node_of(r) == layout.node for n, t in got.items()}
    _report_arrivals(tier, s, nodes, whys, node)
    if direct:
        return _Arrivals(arrived, received, node_whole=not node)
    return _Arrivals(node)


def _route(
    tier: LocalTier,
    manifest: Manifest,
    s: int,
    nodes: dict[int, dict[int, dict[str, int]]],
    reports: list[dict[str, list[int]]],
    persisted: bool,
    *,
    per_rank: bool = False,
) -> tuple[list[Move], dict[int, list[str]], str | None]:
    """Where each missing file comes from (the same answer on every rank): moves from another
    node's copy, fetches from the persistent tier per rank, or why ``s`` cannot be rebuilt.

    ``reports``: each rank's missing files, with the chunks it reads of each. A file several
    ranks of a node report goes whole to one of them (into the node's copy, where the others
    read it), or with ``per_rank`` to each of them, only the chunks it reads (each keeps its
    own)."""
    layout = tier.layout
    damaged: dict[int, set[str]] = {}
    for rank, names in enumerate(reports):
        damaged.setdefault(layout.node_of(rank), set()).update(names)
    moves: list[Move] = []
    fetch: dict[int, list[str]] = {}
    taken: set[tuple[int, str]] = set()  # (node, file): a rank of that node receives it
    for rank, names in enumerate(reports):
        node = layout.node_of(rank)
        for name in names:
            if not per_rank:
                if (node, name) in taken:
                    continue  # another rank of this node receives it
                taken.add((node, name))
            entry = manifest.files[name]
            holder = None
            for hop in range(1, layout.nodes):
                other = (node + hop) % layout.nodes
                if nodes.get(other, {}).get(s, {}).get(name) == entry.size and name not in damaged.get(other, set()):
                    holder = other
                    break
            if holder is not None:
                src = holder * layout.local_world_size + (rank - node * layout.local_world_size)
                moves.append(Move(src, rank, entry, frozenset(names[name]) if per_rank else None))
            elif persisted:
                fetch.setdefault(rank, []).append(name)
            else:
                return [], {}, (
                    f"{name} (read by rank {rank}) has no intact copy on any node, and step {s} was never persisted"
                )
    return moves, fetch, None


def _drop_after(tier: LocalTier, s: int, keep_last: int | None) -> None:
    """This node's leader, after restoring ``s``: delete local steps newer than ``s`` (none of
    them could be rebuilt) and incomplete or surplus ones (best effort)."""
    try:
        for step, names in list_step_dirs(tier.store).items():
            if step > s:
                delete_step(tier.store, step, names)
        apply_retention(tier.store, committed=s, keep_last=keep_last)
    except Exception as e:  # noqa: BLE001 - best effort, after the last collective
        logger.warning("cleaning %s after the restore failed: %s", tier.uri, e)
