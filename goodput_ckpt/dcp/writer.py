"""``CheckpointWriter``: a torch DCP ``StorageWriter`` that writes the goodput format.

DCP call order, and which ranks make each call (see torch's ``StorageWriter``)::

    reset(checkpoint_id)            all ranks, only when dcp.save gets checkpoint_id=
    storage_meta()                  all ranks
    set_up_storage_writer(...)      all ranks: claims this instance for one save
    prepare_local_plan(plan)        all ranks: creates the location
    prepare_global_plan(plans)      coordinator: refuses or clears an existing checkpoint,
                                    names this save's files (a fresh token per save), tells
                                    each rank the layout digest it holds for it
    write_data(plan, planner)       all ranks: lays out, hashes and writes their files; reports
                                    them, without their rows when the layout is the known one
    finish(metadata, results)       coordinator: builds the manifest and commits it

A save that fails anywhere leaves no manifest: its data files are visibly incomplete and are
removed by the next successful save at the same location (with ``known_new`` on S3: by the
caller, a manager's retention). With local staging in front of a mounted volume (``stage_dir=``), ``dcp.save`` returns once the
checkpoint is on local disk; :meth:`CheckpointWriter.durable_future` says when its durable copy
is committed on the volume.

One writer instance serves one save at a time. A second save that overlaps a running one on the
same instance raises :class:`~goodput_ckpt.CheckpointError`, unless the running save's thread
ends within 2 s (a failed save's executor thread is then let go): use one writer per in-flight
``dcp.async_save``.

What the protocol's methods start lives elsewhere, one concern a module: layout
(``engine/layout.py``), hashing and commit (``engine/hashed_write.py``), an item's bytes
(``dcp/write_sources.py``), what ranks report (``dcp/rank_reports.py``), the commit record
(``dcp/commit_build.py``), one save at a time (``dcp/save_claim.py``), staging
(``dcp/staging.py``). This module keeps the call order above in one place.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..engine.hashed_write import (
    check_chunk_size,
    clear_or_refuse_existing,
    data_file_name,
    durable_future,
    publish_manifest,
    remove_stale_files_after_commit,
    write_hashed_files,
)
from ..engine.layout import rank_placements
from ..errors import CheckpointError
from ..storage import Store, is_supported_uri, open_store
from ..storage.base import redact
from .commit_build import HeldLayout, build_manifest, held_layouts
from .compact_plan import refuse_unplanned
from .incremental import IncrementalPlan
from .plan_cache import PlanDigest
from .rank_reports import RankAssignment, rank_report
from .references_write import add_referenced_files, record_stored, referenced_items
from .save_claim import SaveClaim
from .staging import stage_state_dict
from .tensor_bytes import check_byte_order
from .write_sources import resolve_item, save_world_size, shard_shape
from .writer_args import json_checked, positive

__all__ = ["CheckpointWriter", "DEFAULT_CHUNK_SIZE", "DEFAULT_WRITE_THREADS"]

#: Hash-chunk (and write-call) size. 4, 8 and 16 MiB measured alike on local disk
#: (docs/benchmarks.md, "Defaults"), so 8 MiB is kept for other reasons: it is above S3's 5 MiB
#: minimum part size (a chunk can be an S3 part), it bounds in-flight memory at thread_count x
#: 8 MiB, and it is the granule a verifying reader widens partial reads to.
DEFAULT_CHUNK_SIZE = 8 << 20
#: Writer threads. Hashing and the page-cache copy take about two cores; threads beyond two keep
#: both busy while others wait in pwritev or in the store's writeback. 2, 4 and 8 measured alike
#: (docs/benchmarks.md); 8 would only double the in-flight memory.
DEFAULT_WRITE_THREADS = 4


def _now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class CheckpointWriter(StorageWriter, AsyncStager):
    """Write a DCP checkpoint in the goodput format.

    Args:
        uri: where the checkpoint goes: a local path or ``file://`` URL, ``s3://bucket/prefix``,
            or another fsspec URL (``gs://``, ``memory://`` ...).
        thread_count: parallel writer threads per rank (default 4).
        chunk_size: bytes per hash chunk and write call (default 8 MiB).
        overwrite: allow replacing a committed checkpoint at ``uri``. The old manifest is
            removed first, so a crash never leaves it beside new data.
        metadata: JSON-serializable user metadata stored in the manifest.
        files_per_rank: data files per rank (default: 1 on stores with random writes, else
            ``thread_count``).
        reuse: an incremental save (:mod:`.incremental`): the items it names as unchanged are
            referenced where an earlier save of a sibling location stored them, not written.
        known_new: the caller knows that ``uri`` holds no commit record (a ``CheckpointManager``
            step writer); not with ``overwrite``. On S3 the coordinator then makes no request
            before the ranks write; a record there after all still refuses the commit, and
            files of failed earlier saves stay for the caller to remove
            (``engine.hashed_write.clear_or_refuse_existing``). Elsewhere it changes nothing.
        **options: backend options (:class:`~goodput_ckpt.storage.LocalConfig`,
            :class:`~goodput_ckpt.storage.VolumeConfig`, :class:`~goodput_ckpt.storage.S3Config`,
            :class:`~goodput_ckpt.storage.FsspecConfig`). For a local path, ``volume=True`` or
            ``False`` overrides the detection of mounted volumes (docs/volumes.md).

    Raises:
        TypeError: an unknown option.
        ValueError: an unsupported URI or out-of-range argument.
    """

    _synchronize_after_execute = False  # staging is blocking; nothing to synchronize

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        thread_count: int | None = None,
        chunk_size: int | None = None,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        files_per_rank: int | None = None,
        reuse: IncrementalPlan | None = None,
        known_new: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.reuse = reuse
        if known_new and overwrite:
            raise ValueError("known_new and overwrite exclude each other: an overwrite must find the old checkpoint")
        self.known_new = bool(known_new)
        #: This rank's bytes of its last save: written to files, and referenced in earlier saves.
        self.bytes_written = 0
        self.bytes_referenced = 0
        self.thread_count = positive("thread_count", thread_count, DEFAULT_WRITE_THREADS)
        self.chunk_size = positive("chunk_size", chunk_size, DEFAULT_CHUNK_SIZE)
        if not (1 << 12) <= self.chunk_size <= (1 << 30):
            raise ValueError(f"chunk_size must be between 4 KiB and 1 GiB, got {self.chunk_size}")
        self.files_per_rank = None if files_per_rank is None else positive("files_per_rank", files_per_rank, 1)
        self.overwrite = bool(overwrite)
        self.user_metadata = json_checked(metadata or {})
        self._options = dict(options)
        # What DCP logs and records (StorageMeta, the manifest): never a URL's credentials.
        self.checkpoint_id: str | os.PathLike = redact(os.fspath(uri))
        self._store: Store = open_store(uri, self._options)
        check_chunk_size(self._store, self.chunk_size)  # S3: a chunk is a part, >= 5 MiB
        self._is_coordinator = False
        self._assignment: RankAssignment | None = None
        self._held: HeldLayout | None = None  # coordinator: the layouts announced for this save
        self._found: list[str] | None = None  # coordinator: the location's files before this save
        self.committed_record: bytes | None = None  # coordinator: its last save's record, as committed
        self._beside_training = False  # the next save runs beside training: mark_background_save
        self._init_runtime()

    @property
    def store(self) -> Store:
        """The byte store this writer writes through (read-only): its backend configuration is
        ``store.config``, as resolved from the URI and the options (credentials redacted in its
        ``repr``). :meth:`reset` with a new checkpoint id replaces it."""
        return self._store

    # -- pickling (dcp.async_save with the process executor pickles the writer) -----------------
    def _init_runtime(self) -> None:
        self._save_claim = SaveClaim()
        self._durable: concurrent.futures.Future | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_save_claim", None)
        state.pop("_durable", None)
        state["_held"] = None  # the coordinator's entries: this process's, for one save
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- StorageWriter ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = redact(os.fspath(checkpoint_id))
            self._store = open_store(checkpoint_id, self._options)
            check_chunk_size(self._store, self.chunk_size)
            self.known_new = False  # the caller vouched for the old location, not this one
        self._assignment = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_supported_uri(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=secrets.token_hex(8))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                "CheckpointWriter needs use_collectives=True: its manifest is built from every "
                "rank's results on the coordinator"
            )
        self._claim()
        self._is_coordinator = is_coordinator
        self._assignment = None
        self._durable = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            if getattr(plan, "usable", True) is False and not isinstance(plan.storage_data, PlanDigest):
                raise CheckpointError(_PLAN_CACHING)  # (scale) ours carries a digest: plan_cache.py
            self._store.prepare()
        except BaseException:
            self._release()
            raise
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        try:
            refuse_unplanned(plans)  # (scale) compact plans (compact_plan.py) a foreign planner passed on
            self._clear_or_refuse_existing()
        except BaseException:
            self._release()
            raise
        token = secrets.token_hex(6)
        # (scale) the layout each rank had at the last build this process holds entries for: a
        # rank whose layout is the same sends no rows (rank_reports.py). Pinned for this save.
        held = self._held = held_layouts()
        known = held.layouts if held is not None and len(held.layouts) == len(plans) else (None,) * len(plans)
        return [replace(p, storage_data=RankAssignment(i, token, known[i])) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write_rank(plan, planner)
        except BaseException:
            self._release()
            raise
        finally:
            self._beside_training = False
        self._durable = durable_future(self._store)
        if not self._is_coordinator:
            self._release()  # the coordinator holds its claim until finish()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit(metadata, results)
            self._durable = durable_future(self._store)
        finally:
            self._release()
        # (scale) dcp.save broadcasts ``metadata`` to every rank as its result: O(ranks x tensors)
        # bytes each rank unpickles. The commit record holds the truth, so the other ranks get it
        # slim (_SlimWhenPickled); the coordinator's own result stays whole.
        if type(metadata) is Metadata:
            metadata.__class__ = _SlimWhenPickled

    def durable_future(self) -> concurrent.futures.Future[None]:
        """When the checkpoint of this writer's last save is durable at its final location.

        Call it after ``dcp.save`` returned (or ``dcp.async_save``'s future completed). Most
        stores commit before ``dcp.save`` returns, and then the future is already done. With
        local staging (``stage_dir=`` on a mounted volume) the upload runs in the background:
        on the coordinator the future completes when the manifest is on the volume (the
        checkpoint is committed there), on every other rank when this rank's files are on the
        volume. A failed upload or commit sets the future's exception (a
        :class:`~goodput_ckpt.CheckpointError`), and the volume copy stays visibly incomplete.

        Raises:
            CheckpointError: no save has written its data through this writer yet.
        """
        fut = self._durable
        if fut is None:
            raise CheckpointError(
                f"no save to {self._store.uri} has written its data through this writer yet: call "
                "durable_future() after dcp.save returns"
            )
        return fut

    # -- AsyncStager ------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` to CPU memory so training can continue during the write."""
        # dcp.async_save stages in the caller's thread before its save starts, so a claim that
        # this thread holds is stale: a save that failed outside this writer's methods (another
        # rank's error, a planner error) never reached a release.
        self._release()
        self.mark_background_save()
        return stage_state_dict(state_dict)

    def mark_background_save(self) -> None:
        """The next save through this writer runs beside training (``dcp.async_save`` calls
        :meth:`stage` first, which calls this; the manager calls it for its async saves): a local
        store with ``direct_writes=None`` then writes its data files around the page cache, taking
        less CPU from training (``LocalConfig``). Other stores ignore it."""
        self._beside_training = True

    def synchronize_staging(self) -> None:
        """Staging is blocking: nothing to wait for."""

    def close(self) -> None:
        """Nothing to release: its threads are the process's kept writers (engine/worker_pool.py)."""

    # -- one save at a time (save_claim.py) ----------------------------------------------------
    def _claim(self) -> None:
        self._save_claim.claim(self._store.uri)

    def _release(self) -> None:
        self._save_claim.release()
        # A save that failed before write_data must not leave its mark for the next one (a
        # synchronous save after a failed async one would write around the page cache).
        self._beside_training = False

    # -- coordinator: existing checkpoints --------------------------------------------------
    def _clear_or_refuse_existing(self) -> None:
        self._found = clear_or_refuse_existing(self._store, self.overwrite, known_new=self.known_new)  # for _commit

    # -- every rank: layout, hashing, writing ------------------------------------------------
    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        check_byte_order()
        if getattr(planner, "_enable_plan_caching", False):
            raise CheckpointError(_PLAN_CACHING)
        assignment = plan.storage_data
        if not isinstance(assignment, RankAssignment):
            raise CheckpointError("CheckpointWriter.write_data got a plan it did not prepare")
        # Values that are not shards first: the rank's own items in its RankWrites. In the file
        # they go after the shards, together (rank_placements: shards at one offset on every rank).
        items = sorted(plan.items, key=lambda it: it.type == WriteItemType.SHARD)
        own = sum(1 for it in items if it.type != WriteItemType.SHARD)
        refs = referenced_items(self.reuse, items, assignment.token)
        to_write = [i for i in range(len(items)) if i not in refs]
        sources = [resolve_item(items[i], planner) for i in to_write]
        sizes = [s.nbytes for s in sources]
        store = self._store
        if self._beside_training and hasattr(store, "for_background_save"):
            store = store.for_background_save()  # an optional ability (storage/local.py)
        file_count = self.files_per_rank or (1 if store.traits.random_writes else self.thread_count)
        shards = [shard_shape(items[i]) if i >= own else None for i in to_write]
        placements, file_sizes = rank_placements(sizes, shards, file_count, save_world_size(), self.chunk_size)
        names = [data_file_name(assignment.rank_index, f, assignment.token) for f in range(len(file_sizes))]
        entries = write_hashed_files(
            store, names, placements, file_sizes, sources, chunk_size=self.chunk_size, thread_count=self.thread_count
        )
        where = {to_write[p.item]: (p.file, p.offset, p.length) for p in placements}
        files, where = add_referenced_files(entries, where, refs)
        written = tuple((it.index.fqn, _offsets(it), *where[i]) for i, it in enumerate(items))
        self.bytes_written = sum(file_sizes)
        self.bytes_referenced = sum(p.length for p in refs.values())
        if self.reuse is not None:
            record_stored(self.reuse, files, written, self.bytes_written, self.bytes_referenced)
        return rank_report(files, written, items, own=own, assignment=assignment)

    # -- coordinator: the commit --------------------------------------------------------------
    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        held, self._held = self._held, None
        manifest = build_manifest(
            metadata,
            results,
            chunk_size=self.chunk_size,
            created_at=_now_utc(),
            user_metadata=self.user_metadata,
            held=held,
        )
        self.committed_record = publish_manifest(self._store, manifest, replace=self.overwrite)
        found, self._found = self._found, None
        remove_stale_files_after_commit(self._store, set(manifest.files), found)


#: torch's save-plan caching hands a rank whose plan did not change the cached final plan of the
#: previous save, with that save's assignment: its file names. Written again under the same names,
#: an overwrite would replace the committed checkpoint's files before the new one commits.
_PLAN_CACHING = (
    "CheckpointWriter does not support a save planner with enable_plan_caching=True: a rank whose "
    "plan did not change would be handed the previous save's file names. Use a planner without plan caching"
)


class _SlimWhenPickled(Metadata):
    """A ``Metadata`` that pickles as one without chunks, planner data or storage data: what
    ``dcp.save`` returns on the other ranks after a save through :class:`CheckpointWriter` (the full
    metadata: ``CheckpointReader.read_metadata``). Its size does not grow with ranks or tensors."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Metadata, ({},), {"storage_meta": self.storage_meta, "version": getattr(self, "version", None)})


def _offsets(item: WriteItem) -> tuple[int, ...] | None:
    """The item's chunk offsets as a plain tuple (``None`` for an object), as the manifest keys it."""
    return None if item.index.offset is None else tuple(item.index.offset)
