"""The byte-store interface that every backend implements.

A store is rooted at one checkpoint location (a directory, a key prefix) and addresses files by
*relative* names. It knows nothing of torch: the DCP layer above plans which bytes go where,
hashes them and builds the manifest once for all backends. A backend implements only what
differs: how a data file is written (in parallel parts, or once and in order), how a byte range
is read, and how the commit record is published atomically.

Call order for a save (one rank's view)::

    store.prepare()                     # create the location if needed (every rank)
    sink = store.open_sink(name, part_size=chunk)   # one per data file
    sink.write_at(offset, buffers)      # many times; concurrently when store.random_writes
    sink.close()                        # the file is durable once this returns
    # ... coordinator, after every rank closed its sinks:
    store.put_commit_record(MANIFEST, data, replace=...)   # atomic publish: the commit

``sink.abort()`` replaces ``close()`` on any failure and removes what was written.

Optional members (looked up with ``getattr``; a store without them gets the default):

- ``commit_record_atomic`` (default ``True``): whether readers can only ever see the whole commit
  record. A mounted volume cannot promise it (a permissive mount shows a file while it is
  written; a killed writer leaves a truncated one), so there a record that fails to parse or
  validate means *incomplete*, never *corrupt* or *committed*
  (``goodput_ckpt.format.commit_record`` reads it).
- ``prepare_commit(files)``: called by the coordinator just before ``put_commit_record`` with the
  names of every rank's data files that the record commits. A store that uploads data in the
  background (a volume with local staging) needs them to publish the record only once all of
  them are durable, including files that other ranks' stores wrote.
- ``sequential_reads`` (default ``False``): the store streams a file better than it serves
  scattered ranges (a FUSE mount reads ahead within a descriptor; an object-store mount turns a
  seek into a new request). The reader then hands each thread a run of one file's ranges, in
  order, instead of single ranges.
- ``after_commit(fn)``: run ``fn`` (the clean-up of failed saves' files) once the commit
  record is durable, in the background, instead of at once. For stores that commit in the
  background, so the caller does not wait for a listing of the destination.
- ``durable_future()``: a ``concurrent.futures.Future`` that completes when everything this
  store was asked to write for the current save is durable at its destination. Stores whose
  writes are durable when the calls return do not have it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import CheckpointError

__all__ = ["Buffer", "FileSink", "FileSource", "Store", "check_relative_name", "drop_done"]

#: Anything exposing the buffer protocol: ``bytes``, ``bytearray``, ``memoryview``, numpy arrays.
Buffer = object


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


@runtime_checkable
class Store(Protocol):
    """A checkpoint location: a flat namespace of files addressed by relative names."""

    #: Human-readable location for messages. Never contains credentials.
    uri: str
    #: Whether a data file may be written in parts, out of order and concurrently.
    random_writes: bool
    #: The smallest ``part_size`` :meth:`open_sink` accepts (0: no minimum). Object stores that
    #: upload each part as a separate request have one (S3: 5 MiB); the writer refuses a chunk
    #: size below it. Optional: a store without the attribute has no minimum.
    min_part_size: int
    #: Optional (read with ``getattr``, default False): whether each request costs enough (an
    #: object store, billed and throttled per request) that ranks should share one manifest
    #: read instead of each making their own. Local disks and mounts leave it False.
    #: costly_requests: bool

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

    def read_small(self, name: str) -> bytes | None:
        """The whole content of a small file (the manifest), or ``None`` when it does not exist."""

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


def drop_done(views: list[memoryview], done: int) -> None:
    """Remove the first ``done`` bytes from ``views``, in place: what a vectored read or write
    (``preadv``/``pwritev``/``writev``) moved, so a short one continues with the rest."""
    while views and done >= views[0].nbytes:
        done -= views[0].nbytes
        views.pop(0)
    if views and done:
        views[0] = views[0][done:]


def check_relative_name(name: object) -> str:
    """Validate a file name taken from a manifest or computed by the writer.

    A name is a relative POSIX path: not empty, not absolute, no backslashes or NUL bytes, no
    ``.``/``..`` components. Returns the name unchanged.

    Raises:
        CheckpointError: the name is not a safe relative path.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"invalid file name {name!r}: expected a non-empty string")
    bad = (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or posixpath.isabs(name)
        or (len(name) > 1 and name[1] == ":")
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CheckpointError(
            f"unsafe file name {name!r}: checkpoint files must be relative paths without "
            "'..', '.', empty components, backslashes or drive letters",
            path=name,
        )
    return name
