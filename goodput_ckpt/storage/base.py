"""The byte-store interface that every backend implements.

A store is rooted at one checkpoint location (a directory, a key prefix) and addresses files by
*relative* names. It knows nothing of torch: the DCP layer above plans which bytes go where,
hashes them and builds the manifest once for all backends. A backend implements only what
differs: how a data file is written (in parallel parts, or once and in order), how a byte range
is read, and how the commit record is published atomically.

Call order for a save (one rank's view)::

    store.prepare()                     # create the location if needed (every rank)
    sink = store.open_sink(name, part_size=chunk)   # one per data file
    sink.write_at(offset, buffers)      # many times; concurrently when store.traits.random_writes
    sink.close()                        # the file is durable once this returns
    # ... coordinator, after every rank closed its sinks:
    store.put_commit_record(MANIFEST, data, replace=...)   # atomic publish: the commit

``sink.abort()`` replaces ``close()`` on any failure and removes what was written.

What differs between backends is declared, never probed: every store has one frozen
:class:`StoreTraits` record as ``store.traits`` (how it writes, commits and prefers to be read),
and the optional abilities are small protocols a caller tests with ``isinstance``:

- :class:`BackgroundCommit` (a volume with local staging): the store uploads data and publishes
  the commit record in the background. ``prepare_commit(files)`` is called by the coordinator
  just before ``put_commit_record`` with the names of every rank's data files that the record
  commits (it publishes the record only once all of them are durable, including files that
  other ranks' stores wrote); ``after_commit(fn)`` runs ``fn`` (the clean-up of failed saves'
  files) once the record is durable, in the background, so the caller does not wait for a
  listing; ``durable_future()`` completes when everything asked of the store for the current
  save is durable at its destination.
- :class:`StaleUploads` (S3): ``abort_stale_uploads`` reclaims the multipart uploads that killed
  saves left open; the coordinator calls ``abort_stale_uploads_before_save`` once per save.
- :class:`BatchDelete` (S3): ``delete_many`` removes many files in few requests (``DeleteObjects``,
  1,000 keys each). Callers go through :func:`~.bulk.delete_files`, which loops over ``delete``
  on the other stores.
- :class:`SizedListing` (S3): ``list_sizes`` gives every file's size from the listing (1,000 a
  request) instead of one ``HEAD`` each. Callers go through :func:`~.bulk.file_sizes`.

Only this package knows a backend's concrete class; code above it asks the traits.

Messages that every backend gives for the same event are built once, in ``storage/store_rules.py``
(re-exported here with its other shared rules: bounded reads, buffer views, names, redaction:
:func:`missing_file_error`, :func:`truncated_error`, :func:`committed_elsewhere_error`,
:func:`out_of_order_error`, :func:`too_large_error`), and the same event raises the same error
type everywhere (tests/storage/test_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .store_rules import (
    Buffer,
    byte_views,
    check_relative_name,
    committed_elsewhere_error,
    drop_done,
    missing_file_error,
    out_of_order_error,
    read_capped,
    redact,
    too_large_error,
    truncated_error,
)

__all__ = [
    "SMALL_FILE_LIMIT",
    "BackgroundCommit",
    "BatchDelete",
    "Buffer",
    "FileOrigin",
    "FileSink",
    "FileSource",
    "SizedListing",
    "StaleUploads",
    "Store",
    "StoreTraits",
    "byte_views",
    "check_relative_name",
    "committed_elsewhere_error",
    "drop_done",
    "missing_file_error",
    "out_of_order_error",
    "read_capped",
    "redact",
    "too_large_error",
    "truncated_error",
]

#: The default cap of :meth:`Store.read_small`: the largest manifest the format allows (1 GiB).
#: Every small file (manifest, DCP ``.metadata``, safetensors index and sidecar) is read under a
#: cap, checked before the content is read, so an endless or huge file cannot exhaust memory.
SMALL_FILE_LIMIT = 1 << 30


@dataclass(frozen=True, kw_only=True)
class StoreTraits:
    """What a store is like, declared once by each backend (``store.traits``).

    Attributes:
        kind: the backend, for reports: ``"local"``, ``"volume"``, ``"s3"`` or ``"fsspec"``.
        random_writes: a data file may be written in parts, out of order and concurrently.
            Otherwise each file is written by one thread, in order, and the writer spreads a
            rank's bytes over several files.
        min_part_size: the smallest ``part_size`` :meth:`Store.open_sink` accepts (0: none).
            Object stores that upload each part as a separate request have one (S3: 5 MiB); the
            writer refuses a chunk size below it.
        atomic_commit_record: readers only ever see the whole commit record. A mounted volume
            cannot promise it (a permissive mount shows a file while it is written; a killed
            writer leaves a truncated one), so there a record that fails to parse or validate
            means *incomplete*, never *corrupt* or *committed* (:func:`parse_commit_record`).
        can_append: files at ``local_path`` may be opened for appending (a local disk; not a
            volume, which writes each file once): the manager's timeline file needs it.
        costly_requests: each request costs enough (an object store, billed and throttled per
            request) that ranks should share one manifest read instead of each making their own.
        sequential_reads: the store streams a file better than it serves scattered ranges (a
            FUSE mount reads ahead within a descriptor; an object-store mount turns a seek into
            a new request). The reader then hands each thread a run of one file's ranges, in
            order, instead of single ranges.
        local_path: the location as a path of this machine's filesystem (local disk and
            volumes), for tools that open files there directly; ``None`` for remote stores.
    """

    kind: str
    random_writes: bool
    min_part_size: int = 0
    atomic_commit_record: bool = True
    can_append: bool = False
    costly_requests: bool = False
    sequential_reads: bool = False
    local_path: str | None = None


@runtime_checkable
class FileSink(Protocol):
    """One data file being written. Created by :meth:`Store.open_sink`."""

    def write_at(self, offset: int, buffers: Sequence[Buffer]) -> None:
        """Write the concatenation of ``buffers`` at ``offset``.

        Stores with ``random_writes`` accept calls in any order and from several threads at
        once. Other stores require calls in increasing, gap-free offset order from one thread.
        """

    def close(self) -> None:
        """Make the file durable and final. Idempotent."""

    def abort(self) -> None:
        """Discard the file after a failure. Idempotent; never raises for a missing file."""


@runtime_checkable
class FileSource(Protocol):
    """One data file opened for ranged reads. Safe to share between threads."""

    def read_into(self, offset: int, buffers: Sequence[Buffer]) -> None:
        """Fill ``buffers`` (in order) with the bytes starting at ``offset``.

        Raises:
            IncompleteCheckpointError: the file ends before the buffers are full.
        """

    def close(self) -> None:
        """Release the handle. Idempotent."""


class FileOrigin(Protocol):
    """Where data files can be opened for reading: every :class:`Store`, and what is not a
    location at all (a two-tier restore's files received from another node, held in memory)."""

    #: Human-readable origin for messages. Never contains credentials.
    uri: str

    def open_source(self, name: str) -> FileSource:
        """Open the data file ``name`` for ranged reads (see :meth:`Store.open_source`)."""


@runtime_checkable
class Store(Protocol):
    """A checkpoint location: a flat namespace of files addressed by relative names."""

    #: Human-readable location for messages. Never contains credentials (see :func:`redact`).
    uri: str
    #: What the store is like (see :class:`StoreTraits`).
    traits: StoreTraits

    def prepare(self) -> None:
        """Create the location if needed. Called by every rank before writing."""

    def open_sink(self, name: str, *, part_size: int | None = None) -> FileSink:
        """Start writing the data file ``name`` (replacing any file of that name).

        Args:
            part_size: the writer's promise about its ``write_at`` calls: each covers exactly
                ``[k * part_size, (k + 1) * part_size)`` for some ``k``, except the file's last,
                which may be shorter. Stores that upload parts as separate requests number them
                from it (S3: part ``offset // part_size + 1``); others ignore it. ``None``: no
                promise (the store's default part size, where it needs one).
        """

    def open_source(self, name: str) -> FileSource:
        """Open the data file ``name`` for ranged reads.

        Raises:
            IncompleteCheckpointError: the file does not exist.
        """

    def size(self, name: str) -> int | None:
        """The size of ``name`` in bytes, or ``None`` when it does not exist."""

    def read_small(self, name: str, *, max_bytes: int = SMALL_FILE_LIMIT) -> bytes | None:
        """The whole content of a small file (the manifest), or ``None`` when it does not exist.

        The size is checked before the content is read, and the read itself is bounded, so a
        huge or endless file costs no memory.

        Raises:
            FileTooLargeError: the file holds more than ``max_bytes`` bytes.
            CheckpointError: it is not a regular file (local stores; links are refused too).
        """

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        """Publish ``data`` under ``name`` atomically, after making earlier writes durable.

        Readers see either no file or the whole of ``data``, never a prefix.

        Raises:
            CheckpointExistsError: ``name`` exists and ``replace`` is false.
        """

    def list(self) -> list[str]:
        """Relative names of the files at the location (empty when it does not exist)."""

    def delete(self, name: str) -> None:
        """Remove ``name`` durably. Missing files are not an error."""


@runtime_checkable
class BackgroundCommit(Protocol):
    """A store that writes in the background and commits once that is durable (see the module
    docstring for the call order)."""

    def prepare_commit(self, files: Sequence[str]) -> None:
        """Learn every rank's data files that the next commit record commits."""

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the background once the queued commit succeeded."""

    def durable_future(self) -> Future:
        """A future that completes when this save's writes and commit are durable."""


@runtime_checkable
class StaleUploads(Protocol):
    """A store whose killed saves leave hidden, billed uploads behind (S3 multipart uploads)."""

    def abort_stale_uploads(self, *, older_than: float, recursive: bool = False) -> list[str]:
        """Abort the uploads under the location idle for ``older_than`` seconds; their keys."""

    def abort_stale_uploads_before_save(self, *, recursive: bool = False) -> None:
        """Before a save, on one rank (the coordinator) before any rank writes: abort the uploads
        under the location (``recursive``: and nested locations) idle for the store's configured
        age. Best effort: a failure is logged, never raised."""


@runtime_checkable
class BatchDelete(Protocol):
    """A store that deletes many files in one request (S3 ``DeleteObjects``)."""

    def delete_many(self, names: Sequence[str]) -> None:
        """Remove ``names`` durably, in as few requests as the store allows. Missing files are
        not an error.

        Raises:
            CheckpointError: some files could not be deleted (it names them).
        """


@runtime_checkable
class SizedListing(Protocol):
    """A store whose listing carries every file's size (S3 ``ListObjectsV2``)."""

    def list_sizes(self, *, max_entries: int | None = None) -> dict[str, int]:
        """``{relative name: size in bytes}`` of the files at the location, from the listing;
        with ``max_entries``, the listing stops (at a page's end) once that many were listed."""
