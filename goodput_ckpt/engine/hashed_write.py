"""Writing data files chunk by chunk while hashing them, and publishing the manifest.

This is the write half of the goodput format without the DCP protocol around it. ``CheckpointWriter``
uses it for every rank's files; the tools that produce checkpoints without ``dcp.save``
(``reshard``, ``convert``) use the same code, so every checkpoint is laid out, hashed and
committed one way.

Call order::

    clear_or_refuse_existing(store, overwrite)     # coordinator, before any data is written
    entries = write_hashed_files(store, names, placements, file_sizes, sources, ...)
    publish_manifest(store, manifest, replace=...) # the commit
    remove_stale_files(store, keep=set(entries))   # best effort, after the commit
                                                   # (remove_stale_files_after_commit: in the
                                                   # background where the commit is)

Sources are produced lazily: ``write_hashed_files`` asks a source for a byte range only when a
worker is about to hash and write the chunk holding it, and calls ``release()`` once its last
range is written. A source that computes its bytes on demand (reading them from another
checkpoint, say) therefore keeps memory at about ``thread_count`` chunks, whatever its size.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import blake3

from ..errors import OVERWRITE_HINT, CheckpointError, CheckpointExistsError, CorruptCheckpointError
from ..format.commit_record import COMMITTED, MISSING, TORN, file_problems, read_commit_record
from ..format.manifest import ALIGNMENT, MANIFEST_NAME, FileEntry, Manifest, parse_manifest
from ..storage import Store
from ..storage.base import BackgroundCommit, StaleUploads
from .layout import ChunkPlan, Placement, chunk_plans
from .worker_pool import WRITERS, run_bounded

__all__ = [
    "ByteSource",
    "check_chunk_size",
    "clear_or_refuse_existing",
    "data_file_name",
    "data_file_token",
    "durable_future",
    "is_save_file",
    "publish_manifest",
    "remove_stale_files",
    "remove_stale_files_after_commit",
    "write_hashed_files",
]

#: Zero padding between items: alignment, and a shard's slot past its bytes (engine/layout.py).
_ZEROS = bytes(ALIGNMENT)
_DATA_FILE = re.compile(r"rank(\d{5,})-\d{2}\.([0-9a-f]{12})\.bin\Z")
_TMP_FILE = re.compile(r"\.manifest\.json\.tmp-[0-9a-f]+\Z")


class ByteSource(Protocol):
    """The bytes of one item, handed out by range.

    ``view`` may be called from several threads at once, for disjoint ranges, each at most one
    hash chunk long. ``release`` is called once, after the last range was written. A source may
    also define ``recycle(buffer)``: it is then called with each buffer ``view`` returned, once
    the store's ``write_at`` has returned (sinks keep no reference to written buffers), so the
    source can reuse its buffers instead of allocating one per chunk.
    """

    nbytes: int

    def view(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of the item, as any object with the buffer protocol."""

    def release(self) -> None:
        """Drop what the source holds; no ``view`` follows."""


def data_file_name(rank_index: int, file_index: int, token: str) -> str:
    """The writer's name for file ``file_index`` of rank ``rank_index`` in the save ``token``."""
    return f"rank{rank_index:05d}-{file_index:02d}.{token}.bin"


def is_save_file(name: str) -> bool:
    """Whether ``name`` (relative to a location) is a name a save writes there besides its
    commit record: a data file or a temporary record. Only these are ever removed as files of
    failed saves; anything else in a location is not the writer's to delete. A match has no
    ``/`` and no ``..``: it is inside the location."""
    return bool(_DATA_FILE.match(name) or _TMP_FILE.match(name))


def data_file_rank(name: str) -> int | None:
    """The rank that wrote the data file ``name`` (see :func:`data_file_name`), or ``None`` for a
    name the writer does not give (another writer's file)."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


def data_file_token(name: str) -> str | None:
    """The save token in the data file ``name`` (one per save, shared by every rank's files:
    :func:`data_file_name`), or ``None`` for a name the writer does not give."""
    m = _DATA_FILE.match(name)
    return m.group(2) if m else None


def check_chunk_size(store: Store, chunk_size: int) -> None:
    """Refuse a chunk size below the store's smallest part (S3: 5 MiB; each chunk is a part).

    Raises:
        ValueError: ``chunk_size`` is smaller than ``store.traits.min_part_size``.
    """
    minimum = store.traits.min_part_size
    if chunk_size < minimum:
        raise ValueError(
            f"chunk_size={chunk_size} is too small for {store.uri}: each chunk is uploaded as one "
            f"part, and this store's parts must be at least {minimum} bytes; pass "
            f"chunk_size={minimum} or more (the default, 8 MiB, works everywhere)"
        )


def write_hashed_files(
    store: Store,
    names: Sequence[str],
    placements: Sequence[Placement],
    file_sizes: Sequence[int],
    sources: Sequence[ByteSource],
    *,
    chunk_size: int,
    thread_count: int,
    order: Callable[[ChunkPlan], Any] | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> list[FileEntry]:
    """Write ``sources`` into the files ``names`` as ``placements`` say, hashing every chunk.

    Each file is cut into ``chunk_size`` chunks (see :mod:`.layout`); a worker gathers the
    bytes of one chunk (item ranges and zero padding), hashes exactly those bytes and writes
    them, so digests never need a read-back. A sink with ``write_hashed(offset, buffers,
    hasher)`` (S3's, which copies every chunk into its part bodies) is handed the hasher and
    feeds it the bytes as it copies them: one pass over memory instead of two. A sink with
    ``reserve(size)`` (a local file's, which allocates its blocks) is told its file's size right
    after it is opened, before any chunk. On stores with
    random writes every chunk is a task; otherwise each file is written in order, and closed,
    by one worker.

    Args:
        placements: where each item goes; ``placements[i].item`` indexes ``sources``.
        order: sort key for the chunks of all files (default: file by file). Lets a caller
            that reads its sources from elsewhere visit them in their own order.
        on_chunk: called with the byte count of each chunk once it is written (from a worker
            thread), for progress reports.

    Returns:
        One :class:`FileEntry` per name, in order.

    Raises:
        CheckpointError: a write or a source failed; every file written so far was aborted.
    """
    check_chunk_size(store, chunk_size)
    plans = chunk_plans(list(placements), list(file_sizes), chunk_size)
    remaining = [0] * len(sources)
    for chunks in plans:
        for ch in chunks:
            for seg in ch.segments:
                if seg.item >= 0:
                    remaining[seg.item] += 1
    for i, src in enumerate(sources):
        if remaining[i] == 0:
            src.release()  # empty items take part in no chunk
    release_lock = threading.Lock()  # guards ``remaining``: segments finish on many threads

    wide_zeros: list[memoryview] = []  # one chunk of zeros, made at the first long gap, shared

    def write_chunk(sink, ch: ChunkPlan) -> str:
        bufs = []
        for seg in ch.segments:
            if seg.item >= 0:
                bufs.append(sources[seg.item].view(seg.start, seg.end))
            else:  # (a gap longer than the alignment: an empty or short shard's slot)
                n = seg.end - seg.start
                if n > ALIGNMENT and not wide_zeros:
                    wide_zeros.append(memoryview(bytes(chunk_size)))  # a race makes two: harmless
                bufs.append(_ZEROS[:n] if n <= ALIGNMENT else wide_zeros[0][:n])
        h = blake3.blake3()
        # Looked up on the class: a wrapper that forwards attributes (``__getattr__``) to a sink
        # keeps its own ``write_at`` in the path.
        write_hashed = getattr(type(sink), "write_hashed", None)  # optional: see the docstring
        if write_hashed is not None:
            write_hashed(sink, ch.offset, bufs, h)
        else:
            for b in bufs:
                h.update(b)
            sink.write_at(ch.offset, bufs)
        for seg, b in zip(ch.segments, bufs):
            recycle = getattr(sources[seg.item], "recycle", None) if seg.item >= 0 else None
            if recycle is not None:
                recycle(b)
        del bufs
        for seg in ch.segments:
            if seg.item >= 0:
                with release_lock:
                    remaining[seg.item] -= 1
                    done = remaining[seg.item] == 0
                if done:
                    sources[seg.item].release()
        if on_chunk is not None:
            on_chunk(ch.length)
        return h.hexdigest()

    sinks = []
    digests: list[list[str]] = [[""] * len(c) for c in plans]
    try:
        for name, size in zip(names, file_sizes):
            sink = store.open_sink(name, part_size=chunk_size)
            sinks.append(sink)
            # Optional, looked up on the class as write_hashed is (see the docstring).
            reserve = getattr(type(sink), "reserve", None)
            if reserve is not None:
                reserve(sink, size)
        # On the first failure, the chunks not yet started are dropped instead of written.
        if store.traits.random_writes:
            all_chunks = [ch for chunks in plans for ch in chunks]
            if order is not None:
                all_chunks.sort(key=order)

            def put_digest(i: int, digest: str) -> None:
                digests[all_chunks[i].file][all_chunks[i].index] = digest

            run_bounded(
                WRITERS,
                len(all_chunks),
                thread_count,
                lambda i: write_chunk(sinks[all_chunks[i].file], all_chunks[i]),
                put_digest,
            )
        else:

            def write_file(f: int) -> list[str]:
                out = [write_chunk(sinks[f], ch) for ch in plans[f]]
                # Close here, not after every file is written: on a mount or an object
                # store, close flushes the file's tail (uploads its last part), and the
                # files' tails then go up in parallel instead of one after the other.
                sinks[f].close()
                return out

            run_bounded(WRITERS, len(plans), thread_count, write_file, digests.__setitem__)
        for sink in sinks:
            sink.close()
    except BaseException:
        for sink in sinks:
            try:
                sink.abort()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        raise
    return [FileEntry(names[f], file_sizes[f], tuple(digests[f])) for f in range(len(names))]


def clear_or_refuse_existing(store: Store, overwrite: bool, *, known_new: bool = False) -> list[str] | None:
    """Before a save (the coordinator, before any rank writes): refuse a committed checkpoint at
    ``store``, or remove it when allowed; first, on a store whose killed saves leave hidden
    uploads behind (S3), abort the stale ones (:meth:`~..storage.base.StaleUploads.abort_stale_uploads_before_save`).

    ``known_new`` (a :class:`~goodput_ckpt.CheckpointManager`'s step writer, never with
    ``overwrite``): the caller knows of no commit record at ``store``. On a store whose requests
    are billed nothing is then asked before the ranks write (issue 37: the save's one request
    above the minimum): a record there after all (another process committed the step) still
    refuses the commit (:func:`publish_manifest`: the conditional PUT, or check-then-put), whose
    refusal removes this save's files, and files of failed earlier saves at the location are
    left to the caller (the manager's retention removes those the new record does not list:
    ``manager/step_leftovers.py``). Elsewhere (local disk, volumes) the check is a directory
    read, not a request, and runs as without it.

    Done here, once per save, rather than by every rank: a listing per rank is a burst of
    ranks LIST requests against one prefix at every save (docs/scale.md).

    The commit record goes first: from then on the old checkpoint is visibly incomplete, so a
    crash can never pair the old manifest with new data.

    Returns:
        On a store whose requests are billed (``traits.costly_requests``: S3), the files the
        location held before the save (less those removed here): one listing answers both "is a
        record there?" and "which files of failed saves to remove after the commit?", which
        :func:`remove_stale_files_after_commit` then deletes without listing again (issue 37,
        docs/s3.md); with ``known_new`` there, an empty list (nothing removed after the commit).
        ``None`` elsewhere: the record is read, and the location is listed after the commit.

    Raises:
        CheckpointExistsError: a committed checkpoint is there and ``overwrite`` is false.
    """
    if isinstance(store, StaleUploads):
        store.abort_stale_uploads_before_save()
    if known_new and store.traits.costly_requests:
        if overwrite:
            raise ValueError("known_new and overwrite exclude each other: an overwrite must find the old record")
        return []
    found = store.list() if store.traits.costly_requests else None
    record = read_commit_record(store, count_files=False, listing=found)
    if record.status == MISSING:
        return found
    if record.status == TORN:
        # A record that is not a commit (a mounted volume can hold the truncated record of a
        # killed save): the location is saved into as if it had no record.
        store.delete(MANIFEST_NAME)
        return found
    if not overwrite:  # damaged, or a version this library does not know: still a checkpoint
        raise CheckpointExistsError(
            f"{store.uri} already holds a committed checkpoint; {OVERWRITE_HINT} or save to a new location",
            path=store.uri,
        )
    # Decide what belongs to the old checkpoint before anything is deleted: a file it lists, that
    # is a regular file inside the location (the store refuses links and anything reached through
    # one) and has the size it records. Anything else is left where it is, and said.
    owned: list[str] = []
    if record.status == COMMITTED:
        old = record.manifest
        problems = {p.file: p for p in file_problems(store, old)}
        for p in problems.values():
            if p.kind != "missing":
                warnings.warn(
                    f"overwrite: not deleting {store.uri}/{p.file}, listed by the old manifest: it is not "
                    f"provably the old checkpoint's ({p.message})",
                    stacklevel=3,
                )
        owned = [name for name in old.files if name not in problems]
    store.delete(MANIFEST_NAME)
    for name in owned:
        store.delete(name)
    return None if found is None else [n for n in found if n not in set(owned)]


def publish_manifest(store: Store, manifest: Manifest, *, replace: bool) -> bytes:
    """Commit ``manifest``: check that it reads back, then publish it atomically. Returns the
    record's bytes as committed (the manager's retention takes them instead of reading them back).

    Raises:
        CorruptCheckpointError: the manifest does not pass its own validation (a bug); nothing
            was published.
        CheckpointExistsError: another writer committed first; this save's files were removed.
    """
    data = manifest.to_json()
    # Self-check: a manifest we cannot read back must never become a commit record.
    try:
        parse_manifest(data, location=store.uri)
    except CheckpointError as e:
        raise CorruptCheckpointError(f"refusing to commit an invalid manifest: {e}") from e
    if isinstance(store, BackgroundCommit):  # an optional ability (see storage.base)
        store.prepare_commit(list(manifest.files))
    try:
        store.put_commit_record(MANIFEST_NAME, data, replace=replace)
    except CheckpointExistsError:
        for name in manifest.files:
            store.delete(name)
        raise
    return data


def remove_stale_files(store: Store, keep: set[str], found: Sequence[str] | None = None) -> None:
    """Delete data files of failed or replaced saves (best effort, after the commit). ``found``:
    the names listed before the save (:func:`clear_or_refuse_existing`), or ``None`` to list now.

    Why a listing from before the save is enough: every save that failed before this one began
    wrote its files before that listing, which sees them (object stores list after writes
    consistently), and this save's own files carry a fresh token (:func:`data_file_name`), so
    they are in ``keep``. Only files of a save running beside this one at the same location are
    not in it; the post-commit listing never caught those reliably either (one written after it
    stays), they are cleaned by the next save at the location, and the manager's retention
    deletes whatever its step directory holds."""
    try:
        for name in store.list() if found is None else found:
            if name not in keep and is_save_file(name):
                store.delete(name)
    except CheckpointError as e:
        warnings.warn(f"could not remove stale files in {store.uri}: {e}", stacklevel=3)


def remove_stale_files_after_commit(store: Store, keep: set[str], found: Sequence[str] | None = None) -> None:
    """:func:`remove_stale_files`, in the background on stores that commit in the background
    (``after_commit``, see storage.base), so the caller does not wait for a listing."""
    if isinstance(store, BackgroundCommit):
        store.after_commit(lambda: remove_stale_files(store, keep, found))
    else:
        remove_stale_files(store, keep, found)


def durable_future(store: Store) -> Future:
    """The store's future for what it still writes in the background (``durable_future``, see
    storage.base), or a completed one when its writes are durable once they return."""
    if isinstance(store, BackgroundCommit):
        return store.durable_future()
    fut: Future = Future()
    fut.set_result(None)
    return fut
