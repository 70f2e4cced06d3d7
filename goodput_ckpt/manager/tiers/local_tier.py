"""The node-local tier of a two-tier manager: where every save lands, and its replicas.

Every save is written by ``CheckpointWriter`` into this node's ``local_dir`` (each rank's data
files on its own node; the coordinator commits the manifest on its node). Then, in the save
thread, on every rank (:meth:`LocalTier.after_save`):

1. the coordinator's manifest goes to every node, and each other node commits it beside its
   ranks' files: from then on every node holds a committed *local copy* of the step, made of
   the files of its own ranks (and the replicas it receives next);
2. each rank sends its data files to the ranks that keep its replicas, the same local rank
   on each of the next ``replicas`` nodes (:class:`.nodes.NodeLayout`), over the manager's
   group; the receiver checks every chunk against the manifest before writing it (a file an
   incremental step references is not sent: the holder got it with its base's replica);
3. every ``persist_every``-th save is handed to the persist thread (:mod:`.persist`);
4. retention on this node's local directory (its first rank applies it), which keeps the step
   a persist is still reading.

A node's local copy of a step therefore lists every file of the step but holds only some; which
ones a restore can use is decided then, from what every node actually holds
(:mod:`.restore`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from ...dcp.collectives import Group
from ...engine.hashed_write import data_file_rank, remove_stale_files
from ...errors import CheckpointError, as_checkpoint_error
from ...format.commit_record import KeyIndex
from ...format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ...format.references import with_references
from ...storage import open_store
from ...storage.base import Store
from ..job import JobState, foreign_entries, job_of, local_job_dir
from ..retention import apply_retention
from ..step_layout import child_uri, step_dir_name
from .file_moves import Move, run_moves
from .nodes import NodeLayout, local_root
from .persist import Persister, PersistJob

__all__ = ["LocalTier"]

logger = logging.getLogger("goodput_ckpt.tiers")


class LocalTier:
    """This rank's view of the node-local tier (see the module doc).

    Args:
        template: ``local_dir`` (may hold ``{node}``).
        layout: the job's nodes, seen from this rank.
        pg: the manager's group (``None``: one process).
        persister: the persistent tier's thread, or ``None`` when nothing is persisted.
        persist_every: hand every n-th save to ``persister``.
        keep_last: local retention.
        overwrite: as the manager's.
    """

    def __init__(
        self,
        *,
        template: str,
        layout: NodeLayout,
        pg: dist.ProcessGroup | None,
        persister: Persister | None,
        persist_every: int,
        keep_last: int | None,
        overwrite: bool,
        job: JobState,
    ) -> None:
        self.layout = layout
        self.job = job
        #: This node's directory (``local_dir`` with ``{node}`` filled in) and, inside it, the
        #: job's own tier: other jobs' steps there are never seen, replaced or deleted (``..job``).
        self.node_dir = local_root(template, layout.node)
        self.uri = local_job_dir(self.node_dir, job.id)
        self.store: Store = open_store(self.uri, {})
        if self.store.traits.local_path is None:
            raise ValueError(f"local_dir must be a directory on this node's disk, got {template!r}")
        self.pg = pg
        self.group = Group(pg, layout.world_size)
        self.persister = persister
        self.persist_every = persist_every
        self.keep_last = keep_last
        self.overwrite = overwrite
        self._check_not_shared()
        if layout.rank in layout.ranks_of(layout.node)[:1]:
            self._warn_foreign()

    def _warn_foreign(self) -> None:
        """This node's first rank: one warning naming what ``local_dir`` holds of other jobs
        (or of saves made before job identities), which this job ignores and never deletes."""
        others = foreign_entries(self.node_dir, self.job.id)
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            logger.warning(
                "node %d: %s holds checkpoints of other jobs (%s); job %s ignores them and never deletes them",
                self.layout.node,
                self.node_dir,
                shown,
                self.job.id,
            )

    def _check_not_shared(self) -> None:
        """Refuse two nodes whose local directories are one directory (a ``local_dir`` without
        ``{node}`` on a shared filesystem, or simulated nodes on one machine): a replica would
        overwrite the file it copies."""
        if self.layout.nodes == 1:  # (one process is one node)
            return
        seen = self.group.gather(
            (socket.gethostname(), os.path.realpath(self.store.traits.local_path or self.uri), self.layout.node)
        )
        where: dict[tuple[str, str], int] = {}
        for host, path, node in seen:
            other = where.setdefault((host, path), node)
            if other != node:
                raise ValueError(
                    f"nodes {other} and {node} share the local directory {path} on {host}: put {{node}} "
                    "in local_dir so that each node has its own"
                )

    def step_uri(self, step: int) -> str:
        """Where this rank writes ``step``."""
        return child_uri(self.uri, step_dir_name(step))

    def step_store(self, step: int) -> Store:
        return open_store(self.step_uri(step), {})

    # -- after every save (the save thread, every rank) --------------------------------------------
    def after_save(self, step: int, err: CheckpointError | None) -> tuple[CheckpointError | None, float | None]:
        """Spread the local commit of ``step`` (see the module doc), when every rank wrote it.

        Returns:
            ``(error, seconds)``: the save's error (``err``, or what failed here: the save is
            then reported failed though this node may keep a local copy), and how long the
            replication took (``None`` without replicas).
        """
        err, _ = self._agree(step, err)
        if err is not None:
            return err, None
        shared: tuple[bytes, Manifest] | None = None
        try:
            shared = self._share_manifest(step)
        except BaseException as e:  # noqa: BLE001 - reported as the save's failure
            err = as_checkpoint_error(e, f"committing step {step} on node {self.layout.node}")
        err, _ = self._agree(step, err)  # all ranks replicate, or none
        if err is not None or shared is None:
            return err, None
        record, manifest = shared
        seconds = None
        if self.layout.replicas:
            t0 = time.perf_counter()
            err = self._replicate(step, manifest)
            seconds = time.perf_counter() - t0
        # Every rank learns the outcome (a replica that failed on one node fails the save on
        # all, so all hand the same persists over), and none returns before every node committed;
        # the coordinator's persist decision rides on the same gather.
        save = job_of(manifest, self.step_uri(step)).save
        err, due = self._agree(step, err, decision=self._persist_due(save))
        if err is None and due and self.persister is not None:
            self.persister.submit(PersistJob(step, record, manifest, save or 0))
        if self.layout.rank in self.layout.ranks_of(self.layout.node)[:1]:
            persisting = self.persister.in_flight_step if self.persister is not None else None
            apply_retention(self.store, committed=step, keep_last=self.keep_last, protect={persisting} - {None})
        return err, seconds

    def _persist_due(self, save: int | None) -> bool:
        """Whether the save numbered ``save`` goes to the persistent tier: once ``persist_every``
        saves were committed since the newest one handed to it (``..job``), counted from the
        save numbers the tiers hold, so the count survives restarts. Only the coordinator's
        answer counts (:meth:`after_save`)."""
        if self.persister is None:
            return False
        return save is None or save - self.persister.persisted_save >= self.persist_every

    def _agree(
        self, step: int, err: CheckpointError | None, *, decision: bool = False
    ) -> tuple[CheckpointError | None, bool]:
        """``err``, or the first other rank's failure: the same verdict on every rank; and the
        coordinator's ``decision``, on every rank."""
        outcomes = self.group.gather((None if err is None else str(err), decision))
        if err is None and any(o is not None for o, _ in outcomes):
            rank = next(r for r, (o, _) in enumerate(outcomes) if o is not None)
            err = CheckpointError(f"step {step} failed on rank {rank}: {outcomes[rank][0]}")
        return err, bool(outcomes[0][1])

    def _share_manifest(self, step: int) -> tuple[bytes, Manifest]:
        """The coordinator's commit record of ``step`` on every rank, committed on every node."""
        data: Any = None
        if self.layout.rank == 0:
            try:
                data = self.step_store(step).read_small(MANIFEST_NAME)
            except CheckpointError as e:  # still broadcast: the others wait for it
                data = str(e)
        data = self.group.broadcast(data)
        if not isinstance(data, bytes):
            raise CheckpointError(f"the commit record of step {step} cannot be read on node 0: {data or 'it vanished'}")
        manifest = parse_manifest(data, location=self.step_uri(step))
        if self.layout.node != 0 and self.layout.rank == self.layout.ranks_of(self.layout.node)[0]:
            # A record already there is an earlier save's of this step (its run went back to an
            # older step): this save replaces it, and that save's files are not listed any more.
            store = self.step_store(step)
            store.put_commit_record(MANIFEST_NAME, data, replace=True)
            remove_stale_files(store, set(manifest.files))
        return data, manifest

    def _replicate(self, step: int, manifest: Manifest) -> CheckpointError | None:
        """Send each rank's files of ``step`` to its replica holders. A file the step references
        (``base``: an incremental save) is not sent: the holder received it with its base's
        replica; each holder checks that it still has it, at its size (``lacking``), and a save
        whose replica lacks one fails (the next save is then full: ``..incremental_saves``)."""
        moves: list[Move] = []
        lacking: list[str] = []
        mine = with_references(self.step_store(step), manifest)
        for entry in manifest.files.values():
            src = data_file_rank(entry.path)
            if src is None or src >= self.layout.world_size:
                continue
            for dst in self.layout.replica_holders(src):
                if entry.base is None:
                    moves.append(Move(src, dst, entry))
                elif dst == self.layout.rank and mine.size(entry.path) != entry.size:
                    lacking.append(f"{entry.base}/{entry.path}")
        assert self.pg is not None  # replicas need another node, hence a group
        failed = run_moves(
            moves,
            rank=self.layout.rank,
            store=self.step_store(step),
            chunk_size=manifest.chunk_size,
            pg=self.pg,
            sender_uri=f"the local copy of rank {{rank}} ({self.step_uri(step)} on its node)",
            keys=KeyIndex(manifest),
        )
        if lacking:
            return CheckpointError(
                f"replicating step {step}: node {self.layout.node} lacks {len(lacking)} file(s) of earlier steps "
                f"that it references (the step stays on its own nodes); first: {lacking[0]}"
            )
        if failed:
            name, first = next(iter(failed.items()))
            return CheckpointError(
                f"replicating step {step}: {len(failed)} file(s) could not be received on node "
                f"{self.layout.node} (the step stays on its own nodes); first, {name}: {first}"
            )
        return None
