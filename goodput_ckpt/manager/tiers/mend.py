"""A two-tier restore's repairs: where each file a rank reads comes from when its node's copy of
the step lacks it or holds it damaged (:func:`mend`), and the warnings that say so.

A file its node's copy lacks comes from the next tier: a replica (or any copy) on another node,
sent over the group, else the persistent tier (:func:`route` decides, the same on every rank).
Everything that arrives is checked against the agreed commit record, and a step some rank
cannot get a file of is passed, on every rank, with why (:class:`Unrebuildable`). The steps of
the whole restore: :mod:`.restore`.

A file an incremental step references (its ``base``) lies in its base's directory on every tier
(:func:`holding_step`, :func:`node_copy`): each tier keeps the bases of the steps it holds
(``.persist``, ``.local_tier``), so the same lookups find it, one directory over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import CheckpointError, CorruptCheckpointError, as_checkpoint_error, find_checkpoint_error
from ...format.commit_record import KeyIndex
from ...format.manifest import Manifest
from ...format.references import ReferencingStore, with_references
from ...format.schema import FileEntry
from ...storage import open_store
from ...storage.base import Store
from ..step_layout import child_uri, parse_step_dir, step_dir_name
from .file_moves import Move, ReceivedFiles, check_file, copy_file, run_moves
from .local_tier import LocalTier

__all__ = [
    "LOCAL",
    "PERSISTENT",
    "REPLICA",
    "Arrivals",
    "Candidate",
    "Unrebuildable",
    "check_local",
    "holding_step",
    "mend",
    "node_copy",
    "or_error",
    "store_of",
]

logger = logging.getLogger("goodput_ckpt.tiers")

LOCAL, REPLICA, PERSISTENT = "local", "replica", "persistent"

_T = TypeVar("_T")


def or_error(what: str, fn: Callable[[], _T]) -> _T | CheckpointError:
    """``fn()``, or why it failed (any exception, as a :class:`CheckpointError` saying ``what``
    failed): for what one rank does alone before a collective it must still join (``.restore``)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a store may raise OSError and friends, not only ours
        return as_checkpoint_error(e, what)


@dataclass(frozen=True)
class Unrebuildable:
    """Why a candidate step cannot be restored from any tier: the same on every rank, so that
    every rank passes it together for the next candidate (or fails, naming each one's reason)."""

    step: int
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.reason}"


@dataclass(frozen=True)
class Candidate:
    """One step a two-tier restore tries, and where its copies are: this rank's local tier, the
    persistent tier (``None``: none) and its options, the agreed commit record, each node's
    inventory (node -> step -> {file: size}), and whether the step is complete on the
    persistent tier."""

    tier: LocalTier
    persistent: Store | None
    persistent_options: dict[str, Any] | None
    step: int
    manifest: Manifest
    nodes: dict[int, dict[int, dict[str, int]]]
    persisted: bool

    def unrebuildable(self, reason: str) -> Unrebuildable:
        return Unrebuildable(self.step, reason)


@dataclass
class Arrivals:
    """What :func:`mend` got: file -> the tier it came from, for this rank (``direct``) or for
    any rank of its node; the files received into memory (``direct``); and whether the node's
    copy now holds every file its ranks read."""

    tiers: dict[str, str]
    received: ReceivedFiles | None = None
    node_whole: bool = True


def mend(
    c: Candidate, missing: dict[str, set[int]], *, direct: bool = False, why: dict[str, str] | None = None
) -> Arrivals | Unrebuildable:
    """Fetch the files of ``missing`` (those this rank reads that its node's copy lacks or holds
    damaged, with the hash chunks it reads of each) into its node's copy: from another node's copy over the group, else the persistent
    tier, each checked on arrival. Collective. Returns what arrived from which tier to this
    rank's node, by any of its ranks, or why ``s`` cannot be rebuilt (the same answer on every
    rank).

    ``direct``: nothing is written into the node's copy. Each rank gets what it reads itself:
    from another node, the chunks it reads, into memory (:attr:`Arrivals.received`); from the
    persistent tier, nothing yet (the files count as arrived from it, and the load reads them
    there). The load checks both as it reads them. The arrivals are then this rank's own.

    ``why``: why this rank's node lacks some of them (:func:`check_local`), for the warnings.
    """
    tier, persistent, s, manifest, layout = c.tier, c.persistent, c.step, c.manifest, c.tier.layout
    gathered = tier.group.gather(({name: sorted(missing[name]) for name in sorted(missing)}, why or {}))
    reports, whys = [r for r, _ in gathered], [w for _, w in gathered]
    if not any(reports):
        return Arrivals({})  # nothing to fetch anywhere: no second gather
    routed = _route(c, reports, per_rank=direct)
    if isinstance(routed, Unrebuildable):
        return routed
    plan_moves, fetch = routed
    failed: dict[str, CheckpointError] = {}
    here_store = node_copy(tier.store, s, manifest)
    keys = KeyIndex(manifest)
    sender_uri = f"the local copy of step {s} on the node of rank {{rank}}"
    received = ReceivedFiles(f"step {s} as received over the process group", manifest.chunk_size) if direct else None
    made = None
    if not direct and (any(m.dst == layout.rank for m in plan_moves) or fetch.get(layout.rank)):
        # A lost node's directory is made again. If it cannot be, this rank still takes part
        # in the moves (it may send too; what it receives fails to land) and fetches nothing.
        made = or_error(f"making {here_store.uri}", here_store.prepare)
    if plan_moves:  # (moves need another node, hence a group)
        failed = run_moves(
            plan_moves,
            rank=layout.rank,
            store=here_store,
            chunk_size=manifest.chunk_size,
            pg=tier.pg,
            sender_uri=sender_uri,
            keys=keys,
            into=received,
        )
    arrived = {m.name: REPLICA for m in plan_moves if m.dst == layout.rank and m.name not in failed}
    for name, err in failed.items():
        logger.warning("restore of step %d: the replica of %s %s; using the next tier", s, name, damage(err))
    want = sorted(set(fetch.get(layout.rank, [])) | set(failed))
    errors = []
    if want and not c.persisted:
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
        src = or_error(
            f"opening {persistent.uri}",
            lambda: with_references(store_of(persistent, s, c.persistent_options), manifest),
        )
        for name in want:
            got = (
                src
                if isinstance(src, CheckpointError)
                else or_error(
                    f"copying {name} of step {s} from {persistent.uri}",
                    lambda n=name: copy_file(src, here_store, manifest.files[n], manifest.chunk_size, keys=keys),
                )
            )
            if isinstance(got, CheckpointError):
                errors.append(f"{name} from the persistent tier: {got}")
            else:
                arrived[name] = PERSISTENT
    outcomes = tier.group.gather((errors[0] if errors else None, arrived))
    bad = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
    if bad:
        return c.unrebuildable(f"rank {bad[0][0]} could not get its files: {bad[0][1]}")
    # One gather carries both: what arrived on this rank's node, by any of its ranks.
    node = {n: t for r, (_, got) in enumerate(outcomes) if layout.node_of(r) == layout.node for n, t in got.items()}
    _report_arrivals(c, whys, node)
    if direct:
        return Arrivals(arrived, received, node_whole=not node)
    return Arrivals(node)


def _route(
    c: Candidate, reports: list[dict[str, list[int]]], *, per_rank: bool = False
) -> tuple[list[Move], dict[int, list[str]]] | Unrebuildable:
    """Where each missing file comes from (the same answer on every rank): moves from another
    node's copy, fetches from the persistent tier per rank, or why ``s`` cannot be rebuilt.

    ``reports``: each rank's missing files, with the chunks it reads of each. A file several
    ranks of a node report goes whole to one of them (into the node's copy, where the others
    read it), or with ``per_rank`` to each of them, only the chunks it reads (each keeps its
    own)."""
    s, manifest, nodes, layout = c.step, c.manifest, c.nodes, c.tier.layout
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
            held_in = holding_step(entry, s)
            holder = None
            for hop in range(1, layout.nodes):
                other = (node + hop) % layout.nodes
                if nodes.get(other, {}).get(held_in, {}).get(name) == entry.size and name not in damaged.get(
                    other, set()
                ):
                    holder = other
                    break
            if holder is not None:
                src = holder * layout.local_world_size + (rank - node * layout.local_world_size)
                moves.append(Move(src, rank, entry, frozenset(names[name]) if per_rank else None))
            elif c.persisted:
                fetch.setdefault(rank, []).append(name)
            else:
                return c.unrebuildable(
                    f"{name} (read by rank {rank}) has no intact copy on any node, and step {s} was never persisted"
                )
    return moves, fetch


def check_local(c: Candidate, files: dict[str, set[int]], verify: bool) -> tuple[set[str], dict[str, str]]:
    """The files of ``files`` this node's copy of ``c.step`` lacks, or holds with a damaged chunk
    among those this rank reads (``files``: name -> chunk indices), and why, where it is not
    simply absent (name -> a short reason, for :func:`_report_arrivals`)."""
    manifest = c.manifest
    step_store = node_copy(c.tier.store, c.step, manifest)
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
                notes[name] = damage(e)
    return missing, notes


def damage(err: CheckpointError) -> str:
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


def holding_step(entry: FileEntry, s: int) -> int | None:
    """The step whose directory holds ``entry`` of step ``s``: ``s``, or the step an incremental
    save references it in (``base``; ``None`` for a base that is not a step directory)."""
    return s if entry.base is None else parse_step_dir(entry.base)


class _NodeCopy(ReferencingStore):
    """A node's copy of a step in which the files the step references resolve in their base's
    directory on the same node, for reads, sizes and writes alike: a repair writes a referenced
    file where every later load reads it, its base's directory (the bytes are checked against
    the digests the base's own manifest records for them, which the referencing entry copies)."""

    def open_sink(self, name: str, **kwargs: Any) -> Any:
        routed = self._routes.get(name)
        if routed is None:
            return self.inner.open_sink(name, **kwargs)
        return self._parent.open_sink(routed, **kwargs)


def node_copy(root: Store, s: int, manifest: Manifest) -> Store:
    """This node's copy of step ``s`` under the node-local ``root``, with the files ``manifest``
    references resolved in their bases (:class:`_NodeCopy`)."""
    inner = store_of(root, s)
    return _NodeCopy(inner, manifest) if manifest.bases() else inner


def store_of(root: Store, s: int, options: dict[str, Any] | None = None) -> Store:
    """The checkpoint location of step ``s`` under ``root`` (``options``: the root's backend
    options, such as an S3 ``endpoint_url``)."""
    return open_store(child_uri(root.uri, step_dir_name(s)), options or {})


#: How :func:`_report_arrivals` names the tier a file was read from.
_FROM = {REPLICA: "another node's replica", PERSISTENT: "the persistent tier"}


def _report_arrivals(c: Candidate, why: list[dict[str, str]], node_arrivals: dict[str, str]) -> None:
    """A node's first rank, once its ranks got every file they read that its copy of ``s``
    lacks or holds damaged (``node_arrivals``: file -> the tier it came from): one warning for a
    node that holds no copy of ``s`` at all (a lost node), else one per file, with why
    (``why``: every rank's reasons). Only the facts: the restore already did what can be done."""
    tier, s, layout = c.tier, c.step, c.tier.layout
    if not node_arrivals or layout.rank not in layout.ranks_of(layout.node)[:1]:
        return
    if s not in c.nodes.get(layout.node, {}):
        used = " and ".join(_FROM[t] for t in sorted(set(node_arrivals.values())))
        logger.warning(
            "restore of step %d: node %d holds no copy of it (%s); its ranks read %d file(s) from %s",
            s,
            layout.node,
            tier.uri,
            len(node_arrivals),
            used,
        )
        return
    reasons = {n: r for rank, w in enumerate(why) if layout.node_of(rank) == layout.node for n, r in w.items()}
    for name in sorted(node_arrivals):
        logger.warning(
            "restore of step %d: node %d's copy of %s %s; read from %s",
            s,
            layout.node,
            name,
            reasons.get(name, "is missing"),
            _FROM[node_arrivals[name]],
        )
