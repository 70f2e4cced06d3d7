"""``CheckpointReader``: a torch DCP ``StorageReader`` for the goodput format.

DCP call order (all ranks)::

    reset(checkpoint_id)            only when dcp.load gets checkpoint_id=
    read_metadata()                 parses and validates the JSON manifest; checks file sizes
    set_up_storage_reader(md, ...)
    prepare_local_plan / prepare_global_plan   (unchanged)
    read_data(plan, planner)        reads only the byte ranges the plan needs, in parallel,
                                    verified, straight into the destination tensors

Nothing here unpickles untrusted bytes: metadata comes from JSON, and non-tensor values are
decoded with ``torch.load(weights_only=True)`` unless the caller opts in with
``trust_pickle=True``.

This module owns the protocol, the manifest and the reads (which tasks, on which threads, each
chunk verified); what a single ``ReadItem`` needs and how its bytes reach the planner lives in
``dcp/read_items.py``.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.manifest_load import load_manifest
from ..engine.read_plan import Request, Task, plan_tasks, sequential_lanes
from ..engine.read_runs import run_jobs
from ..errors import CheckpointError, IncompleteCheckpointError, remember_swallowed
from ..format.commit_record import KeyIndex, bad_chunks, checksum_error, short_read_error
from ..format.dcp_metadata import StoredRange, to_dcp_metadata
from ..format.grid import GridChunks
from ..format.manifest import Manifest, TensorEntry
from ..format.references import with_references
from ..storage import FileSource, Store, is_supported_uri, open_store
from ..storage.base import FileOrigin, redact
from .manifest_share import load_shared
from .read_items import finish, item_request
from .read_sources import ReadSources
from .tensor_bytes import byte_view, check_byte_order

__all__ = ["CheckpointReader", "DEFAULT_READ_THREADS"]

#: Reader threads: several reads in flight keep the disk's queue busy. 4, 8 and 16 measured the
#: same here (docs/benchmarks.md, "Defaults"); 8 keeps a deeper queue for faster disks at no
#: memory cost (reads land in the destination tensors).
DEFAULT_READ_THREADS = 8
#: Bytes per read task (whole hash chunks when verifying): large enough to amortize a syscall and
#: a hash call, small enough to spread one large tensor over every thread; 8 to 64 MiB measured
#: within noise (docs/benchmarks.md), and 16 MiB leaves about 8 tasks per thread per GiB for balance.
TASK_BYTES = 16 << 20
#: Bytes read at a time by a verified task on a local disk, each piece hashed as soon as it is
#: in: the reader threads then take turns at the disk and the CPUs instead of all reading their
#: 16 MiB, then all hashing it (a cold 144 MiB file, 8 threads: 0.20 s read whole then hashed,
#: 0.15 s in 2 MiB pieces, the same CPU; warm 0.12 and 0.10 s: benchmarks/probe_read_pieces.py).
READ_PIECE = 2 << 20


class CheckpointReader(StorageReader):
    """Read a goodput-ckpt checkpoint with ``dcp.load``.

    Args:
        uri: the checkpoint location: a local path or ``file://`` URL, ``s3://bucket/prefix``,
            or another fsspec URL.
        verify: check the blake3 of every chunk read; a mismatch raises
            :class:`~goodput_ckpt.CorruptCheckpointError` naming the file, byte range and keys.
            Reads are widened to whole chunks so that every byte read is checked.
        thread_count: parallel reads per rank (default 8).
        trust_pickle: decode non-tensor values with full pickle instead of
            ``torch.load(weights_only=True)``. Only for checkpoints you trust.
        process_group: the group ``dcp.load`` runs on, when not the default one.
        share_manifest: when ``torch.distributed`` is initialized, rank 0 of ``process_group``
            reads and checks the manifest in ``read_metadata`` and broadcasts it; the other ranks
            make no request for it. Every rank of the group must then load together, as
            ``dcp.load`` does. The default (``None``) shares on object stores (S3, fsspec), where
            N ranks' requests cost money and throttling, and not on local disks and mounts,
            where a read is cheap and a partial load (``dcp.load(..., no_dist=True)`` on some
            ranks only) must not wait for ranks that never come. ``True`` forces sharing; pass
            ``False`` for a partial load from an object store.
        sources: where the bytes come from when not all from one complete location (a node's
            partial copy, a manifest the caller already parsed, files checked on arrival or read
            from another tier): :class:`~goodput_ckpt.dcp.read_sources.ReadSources`. Default: a
            plain load of ``uri``.
        **options: backend options (:class:`~goodput_ckpt.storage.LocalConfig`,
            :class:`~goodput_ckpt.storage.VolumeConfig`, :class:`~goodput_ckpt.storage.S3Config`,
            :class:`~goodput_ckpt.storage.FsspecConfig`). For a local path, ``volume=True`` or
            ``False`` overrides the detection of mounted volumes (docs/volumes.md).

    On an error during ``read_data`` the destination tensors may be partly overwritten.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        verify: bool = True,
        thread_count: int | None = None,
        trust_pickle: bool = False,
        process_group: Any = None,
        share_manifest: bool | None = None,
        sources: ReadSources | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if thread_count is not None and (
            isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1
        ):
            raise ValueError(f"thread_count must be a positive integer, got {thread_count!r}")
        self.verify = bool(verify)
        self.thread_count = thread_count or DEFAULT_READ_THREADS
        self.trust_pickle = bool(trust_pickle)
        self.process_group = process_group
        self.share_manifest = share_manifest
        sources = sources if sources is not None else ReadSources()
        self.partial = sources.partial
        self.checked_files = sources.checked_files
        #: ``sources.read_from``; a caller may empty it after a load to free received chunks.
        self.read_from: dict[str, FileOrigin] = dict(sources.read_from)
        self._options = dict(options)
        # What DCP logs and records (StorageMeta, the manifest): never a URL's credentials.
        self.checkpoint_id: str | os.PathLike = redact(os.fspath(uri))
        self._store: Store = open_store(uri, self._options)
        self._manifest: Manifest | None = sources.manifest
        # _manifest came from shared_manifest() or the caller, and no load used it yet
        self._preloaded = sources.manifest is not None
        self._storage_data: dict[Any, StoredRange] = {}
        self._chunk_cache: dict[str, dict[tuple[int, ...], Any]] = {}
        self._key_index: tuple[Manifest, KeyIndex] | None = None
        #: The keys of the items this reader has read from storage (since ``reset``), each with
        #: how many saved chunks of it were read: what a restore record reports, e.g. how many old
        #: ranks' loader states this rank read (one chunk per rank).
        self.keys_read: Counter[str] = Counter()
        #: Per key, the extent along dim 0 this reader read: for a tensor saved a row per rank
        #: (``dcp.rank_rows``), how many ranks' rows.
        self.rows_read: Counter[str] = Counter()

    @property
    def store(self) -> Store:
        """The byte store this reader reads through (read-only): its backend configuration is
        ``store.config``, as resolved from the URI and the options. :meth:`reset` with a new
        checkpoint id replaces it."""
        return self._store

    @property
    def manifest(self) -> Manifest:
        """The validated manifest (read on first use, by this rank alone)."""
        if self._manifest is None:
            self._manifest = load_manifest(self._store, check_files=not self.partial)
        return self._manifest

    def shared_manifest(self, record: bytes | None = None) -> Manifest:
        """The validated manifest, read once for the whole group: collective over
        ``process_group``, like ``read_metadata`` (every rank calls it together).
        ``record``: the commit record's bytes where this rank read them already (a restore's
        clean-up did, on the coordinator): parsed and checked the same way, not read again.

        For a caller that plans from the manifest before ``dcp.load`` (the manager's restore):
        with :attr:`manifest` every rank would read the record and check every data file's size,
        ranks x files requests on an object store. The next ``read_metadata`` takes the manifest
        read here instead of reading it again.

        Raises:
            CheckpointError: what reading it raised (on rank 0: the original error).
        """
        self._manifest = self._load_shared(record)
        self._preloaded = True
        return self._manifest

    # -- StorageReader ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = redact(os.fspath(checkpoint_id))
            self._store = open_store(checkpoint_id, self._options)
            self.checked_files = frozenset()  # they were checked at the old location
            self.read_from = {}  # they held the old checkpoint
        self._manifest = None
        self._preloaded = False
        self._storage_data = {}
        self._chunk_cache = {}
        self._key_index = None
        self.keys_read = Counter()
        self.rows_read = Counter()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_supported_uri(checkpoint_id)

    def _shares_manifest(self) -> bool:
        if self.share_manifest is not None:
            return bool(self.share_manifest)
        return self._store.traits.costly_requests

    def _load_shared(self, record: bytes | None = None) -> Manifest:
        # Collective when a process group exists: one rank reads, the others receive it.
        return load_shared(
            lambda: load_manifest(self._store, check_files=not self.partial, record=record),
            group=self.process_group,
            enabled=self._shares_manifest(),
        )

    def read_metadata(self) -> Metadata:
        try:
            if not self._preloaded:  # shared_manifest() just read it for this load
                self._manifest = self._load_shared()
            self._preloaded = False
        except CheckpointError as e:
            # torch 2.13's dcp.load re-raises this as a bare AssertionError that keeps only the
            # message; remembered so that find_checkpoint_error can give the typed error back.
            remember_swallowed(e)
            raise
        self._chunk_cache = {}
        return to_dcp_metadata(self._manifest)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage_data = metadata.storage_data or {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        check_byte_order()
        self._read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- the read path ----------------------------------------------------------------------
    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        manifest = self.manifest
        storage = self._storage_data or to_dcp_metadata(manifest).storage_data
        requests: list[Request] = []
        for item in plan.items:
            loc = storage.get(item.storage_index)
            if not isinstance(loc, StoredRange):
                raise CheckpointError(
                    f"item {item.storage_index.fqn!r} is not in the checkpoint", key=item.storage_index.fqn
                )
            req = item_request(manifest, item, loc, planner, self._chunk_index, lambda r: self._finish(r, planner))
            if req is not None:
                requests.append(req)
        file_sizes = {f.path: f.size for f in manifest.files.values()}
        read_from = self.read_from
        # What is not hashed: the files the caller checked, and without ``verify`` the files
        # read from this location; a file read from elsewhere only when the caller checked it.
        checked = self.checked_files | (frozenset() if self.verify else frozenset(file_sizes) - read_from.keys())
        verify = self.verify or bool(read_from.keys() - self.checked_files)
        # Hashed piece by piece as read (READ_PIECE): this location's files on a local disk, where
        # a piece costs one pread; not object stores (a request each) or mounts (read_runs' lanes).
        by_piece = verify and self._store.traits.kind == "local"
        tasks = plan_tasks(
            requests,
            chunk_size=manifest.chunk_size,
            verify=verify,
            file_sizes=file_sizes,
            task_bytes=TASK_BYTES,
            unverified=checked,
        )
        sources: dict[str, FileSource] = {}
        alloc_lock = threading.Lock()

        def job_done(job: list[Task]) -> None:
            for part in (p for t in job for p in t.parts):
                r = part.request
                if r is not None:
                    r.pending -= 1
                    if r.pending == 0:
                        self._finish(r, planner)

        own = with_references(self._store, manifest)  # an incremental save's files live in siblings
        try:
            for name in sorted({t.file for t in tasks}):
                try:
                    sources[name] = read_from.get(name, own).open_source(name)
                except IncompleteCheckpointError as e:  # listed in a committed manifest: corrupt
                    size = manifest.files[name].size
                    raise short_read_error(e, self._keys(manifest).joined(name, 0, size), (0, size)) from e
            # A job is one task, or on stores that prefer it (mounted volumes: see storage.base)
            # a run of one file's tasks read in order by one thread (see read_runs).
            if self._store.traits.sequential_reads:
                jobs = sequential_lanes(tasks, self.thread_count)
            else:
                jobs = [[t] for t in tasks]
            run_jobs(
                jobs,
                threads=self.thread_count,
                read=lambda t: self._read_task(
                    t,
                    sources[t.file],
                    manifest,
                    alloc_lock,
                    hash_as_read=by_piece and t.file not in checked and t.file not in read_from,
                ),
                verify=(lambda t, bufs: None if bufs is None or t.file in checked else self._verify(t, bufs, manifest))
                if verify
                else None,
                job_done=job_done,
            )
            for item in plan.items:
                self.keys_read[item.storage_index.fqn] += 1  # one item per saved chunk read
                if item.type == LoadItemType.TENSOR and len(item.lengths):
                    self.rows_read[item.storage_index.fqn] += int(item.lengths[0])
        finally:
            for src in sources.values():
                src.close()

    def _chunk_index(self, entry: TensorEntry) -> Any:
        """A lookup from a chunk's offsets to the chunk: a grid finds it by arithmetic."""
        if isinstance(entry.chunks, GridChunks):
            return entry.chunks
        index = self._chunk_cache.get(entry.key)
        if index is None:
            index = self._chunk_cache[entry.key] = {c.offsets: c for c in entry.chunks}
        return index

    def _read_task(
        self,
        task: Task,
        source: FileSource,
        manifest: Manifest,
        alloc_lock: threading.Lock,
        *,
        hash_as_read: bool = False,
    ) -> list[memoryview] | None:
        """Read ``task`` into its requests' buffers (scratch for gaps); returns the buffers, or
        with ``hash_as_read`` reads and verifies it a ``READ_PIECE`` at a time and returns ``None``."""
        bufs: list[memoryview] = []
        for part in task.parts:
            r = part.request
            if r is None:
                bufs.append(memoryview(bytearray(part.end - part.start)))
                continue
            if r.buffer is None:
                with alloc_lock:
                    if r.buffer is None:
                        job = r.item
                        job.staging = torch.empty(job.numel, dtype=job.dtype)
                        r.buffer = byte_view(job.staging)
            bufs.append(r.buffer[part.start - r.start : part.end - r.start])
        try:
            if not hash_as_read:
                source.read_into(task.start, bufs)
                return bufs
            self._verify(task, _pieces(source, task.start, bufs), manifest)  # bad_chunks pulls each piece
        except IncompleteCheckpointError as e:
            keys = self._keys(manifest).joined(task.file, task.start, task.end)
            raise short_read_error(e, keys, e.byte_range) from e
        return None

    def _keys(self, manifest: Manifest) -> KeyIndex:
        """Which keys own a byte range, for error messages; built on the first error only."""
        cached = self._key_index
        if cached is None or cached[0] is not manifest:
            cached = self._key_index = (manifest, KeyIndex(manifest))
        return cached[1]

    def _verify(self, task: Task, bufs: Iterable[memoryview], manifest: Manifest) -> None:
        # A verified read covers whole chunks (read_plan widens it), from a chunk boundary.
        cs = manifest.chunk_size
        bad = bad_chunks(manifest.files[task.file], cs, task.start, bufs)
        if bad:
            lo, hi = bad[0] * cs, min(task.end, (bad[0] + 1) * cs)
            store = self.read_from.get(task.file, self._store)
            raise checksum_error(store.uri, task.file, lo, hi, bad[0], self._keys(manifest).keys(task.file, lo, hi))

    def _finish(self, req: Request, planner: LoadPlanner) -> None:
        finish(req, planner, trust_pickle=self.trust_pickle)


def _pieces(source: FileSource, start: int, bufs: list[memoryview]) -> Iterator[memoryview]:
    """``bufs`` filled from ``source`` at ``start`` a ``READ_PIECE`` at a time, each piece
    yielded once it is read (and hashed by the consumer before the next is read)."""
    offset = start
    for buf in bufs:
        for i in range(0, buf.nbytes, READ_PIECE):
            piece = buf[i : i + READ_PIECE]
            source.read_into(offset, [piece])
            offset += piece.nbytes
            yield piece
