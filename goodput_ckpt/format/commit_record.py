"""A location's commit record, read in one place, and the checks every reader makes against it.

Before this module, the reader, ``verify``, ``inspect``, ``ls``, retention and save-over-existing
each read ``manifest.json`` and judged it in their own words. Now each of them calls
:func:`read_commit_record`, which returns a tagged :class:`CommitRecord`:

- ``missing``: no record (``file_count`` says whether anything else is there);
- ``torn``: a record that does not validate, on a store whose records are written in place (a
  mounted volume): a save still running or killed while writing it; never a commit;
- ``corrupt``: a record that does not validate where records are published atomically (local
  disk, S3): it was damaged after its commit;
- ``unsupported``: a format version this library does not read;
- ``committed``: a valid record, with its :class:`~.schema.Manifest`.

It is also the one home of what a reader checks against a committed manifest: the data files'
sizes (:func:`file_problems`), whether chunks match their digests (:func:`bad_chunks`) and the
error that says they do not (:func:`checksum_error`); which keys own a byte range
(:class:`KeyIndex`) lives in :mod:`.key_index` and is re-exported here. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import blake3

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from ..storage.base import Store
from ..storage.bulk import file_sizes
from .key_index import KeyIndex
from .parse import parse_manifest
from .schema import MANIFEST_NAME, FileEntry, Manifest
from .seal import seal_of

__all__ = [
    "COMMITTED",
    "CORRUPT",
    "MISSING",
    "TORN",
    "UNSUPPORTED",
    "CommitRecord",
    "FileProblem",
    "KeyIndex",
    "bad_chunks",
    "checksum_error",
    "file_problems",
    "foreign_layout_message",
    "no_record_message",
    "parse_commit_record",
    "read_commit_record",
    "short_read_error",
]

MISSING, TORN, CORRUPT, UNSUPPORTED, COMMITTED = "missing", "torn", "corrupt", "unsupported", "committed"

T = TypeVar("T")


def parse_commit_record(store: object, name: str, data: bytes, parse: Callable[[bytes], T]) -> T:
    """``parse(data)``, the commit record ``name`` read from ``store``, judged by how it commits.

    Where readers only ever see the whole record (``store.traits.atomic_commit_record``), a record that
    does not validate, its own digest included, was damaged after its commit: ``parse``'s
    :class:`CorruptCheckpointError` goes through. Where the record is written in place under its
    final name (a mounted volume), it may still be being written or be the truncated record of a
    killed save: :class:`IncompleteCheckpointError`, never a commit and never corruption.

    Raises:
        CorruptCheckpointError: the record is invalid, on a store with atomic records.
        IncompleteCheckpointError: the record is invalid, on a store without them.
        CheckpointError: whatever else ``parse`` raises (an unknown version, say).
    """
    try:
        return parse(data)
    except CorruptCheckpointError as e:
        if store.traits.atomic_commit_record:
            raise
        where = e.path or f"{store.uri}/{name}"
        raise IncompleteCheckpointError(
            f"{where} is on a mounted volume and does not validate ({e}): the save that wrote it "
            "was interrupted or is still running. Load an earlier checkpoint.",
            path=e.path,
            byte_range=e.byte_range,
        ) from e


def no_record_message(uri: str, file_count: int) -> str:
    """What a location with files but no commit record is (the one wording of it)."""
    return (
        f"{uri} holds {file_count} file(s) but no {MANIFEST_NAME}: the save that wrote them never "
        "committed (interrupted, failed or still running)"
    )


#: torch DCP's commit record (``FileSystemWriter``), here only to recognise its layout.
_DCP_METADATA = ".metadata"


def foreign_layout_message(uri: str, names: Collection[str]) -> str | None:
    """What a location without our commit record is, when its files are a layout we know
    (the one home of this recognition); ``None`` when they look like an interrupted save.

    Why: a complete stock DCP checkpoint, a Hugging Face safetensors directory or a manager
    root has files and no ``manifest.json`` at its top, just like a save of ours that never
    committed. Calling them "never committed" would make a script conclude a good
    checkpoint is broken; the message says what they are and what reads them.
    """
    top = [n for n in names if "/" not in n]
    if _DCP_METADATA in top:
        return (
            f"{uri} is a torch DCP checkpoint (FileSystemWriter layout: {_DCP_METADATA} and .distcp files), not a "
            "goodput-ckpt one: load it with dcp.load(..., storage_reader=FileSystemReader(path)), or convert it: "
            "goodput-ckpt convert SRC DST --to goodput"
        )
    if any(n.endswith(".safetensors") for n in top):
        return (
            f"{uri} is a safetensors directory (Hugging Face layout), not a goodput-ckpt checkpoint: load it with "
            "safetensors or from_pretrained, or convert it: goodput-ckpt convert SRC DST --to goodput"
        )
    subdirs = sorted({n.split("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith("/" + MANIFEST_NAME)})
    if subdirs:
        return (
            f"{uri} holds checkpoints in sub-directories ({', '.join(subdirs[:3])}{', ...' if len(subdirs) > 3 else ''}), "
            "it is not one itself (a CheckpointManager root?): list them with goodput-ckpt ls and pass one of them"
        )
    return None


@dataclass(frozen=True)
class CommitRecord:
    """What :func:`read_commit_record` found (see the module docstring for ``status``).

    Attributes:
        uri: the checkpoint location.
        manifest: the validated manifest (``committed`` only).
        error: why the record is not a commit (``torn``, ``corrupt``, ``unsupported``).
        file_count: files at the location (``missing`` only).
        record_bytes: the record's size (0 when missing).
        foreign: what the location is instead, when it is a layout of another tool or a
            manager root (``missing`` only; :func:`foreign_layout_message`).
        digest: the record's own digest (``committed`` only; :func:`.seal.seal_of`): equal
            digests, the same record.
    """

    status: str
    uri: str
    manifest: Manifest | None = None
    error: CheckpointError | None = None
    file_count: int = 0
    record_bytes: int = 0
    foreign: str | None = None
    digest: str | None = None

    @property
    def message(self) -> str:
        if self.foreign is not None:
            return self.foreign
        if self.status == MISSING:
            return no_record_message(self.uri, self.file_count) if self.file_count else f"no checkpoint at {self.uri}"
        return str(self.error) if self.error is not None else "committed"

    def manifest_or_raise(self) -> Manifest:
        """The manifest of a committed record; otherwise the error that says why there is none.

        Raises:
            CheckpointNotFoundError: nothing is stored at the location, or another tool's
                checkpoint or a manager root is (``foreign``).
            IncompleteCheckpointError: files but no record, or a torn record.
            CorruptCheckpointError: a damaged record.
            CheckpointError: an unsupported version (``version`` says which).
        """
        if self.manifest is not None:
            return self.manifest
        if self.error is not None:
            raise self.error
        if self.foreign is not None:
            raise CheckpointNotFoundError(self.foreign, path=self.uri)
        if self.file_count:
            raise IncompleteCheckpointError(f"{self.message}. Load an earlier checkpoint.", path=self.uri)
        raise CheckpointNotFoundError(self.message, path=self.uri)


def read_commit_record(
    store: Store,
    directory: str = "",
    *,
    location: str | None = None,
    listing: Collection[str] | None = None,
    count_files: bool = True,
    data: bytes | None = None,
) -> CommitRecord:
    """Read and judge the commit record of ``store`` (or of its sub-directory ``directory``).

    Args:
        location: the checkpoint's URI for messages (default: the store's, plus ``directory``).
        listing: the names in the checkpoint (relative to it), when the caller already listed
            them: a listing without the record is ``missing`` without a read, and counts the
            files of a location without a record.
        count_files: list the location to count its files when there is no record (a caller
            that only asks whether a record exists saves the listing).
        data: the record's bytes, when the caller read them already (a restore's clean-up
            read the newest step's record just before its load): judged without a read.

    Raises:
        CheckpointError: the store cannot be read or listed at all (permissions, network).
    """
    name = f"{directory}/{MANIFEST_NAME}" if directory else MANIFEST_NAME
    uri = location or (f"{store.uri.rstrip('/')}/{directory}" if directory else store.uri)
    if data is None and (listing is None or MANIFEST_NAME in listing):
        data = store.read_small(name)
    if data is None:
        if listing is None and count_files:
            names = store.list()
            listing = [n[len(directory) + 1 :] for n in names if n.startswith(f"{directory}/")] if directory else names
        foreign = foreign_layout_message(uri, listing) if listing else None
        return CommitRecord(MISSING, uri, file_count=len(listing or ()), foreign=foreign)
    try:
        manifest = parse_commit_record(store, name, data, lambda d: parse_manifest(d, location=uri))
    except IncompleteCheckpointError as e:
        return CommitRecord(TORN, uri, error=e, record_bytes=len(data))
    except CorruptCheckpointError as e:
        return CommitRecord(CORRUPT, uri, error=e, record_bytes=len(data))
    except CheckpointError as e:  # parse_manifest raises the base class only for a version
        return CommitRecord(UNSUPPORTED, uri, error=e, record_bytes=len(data))
    return CommitRecord(COMMITTED, uri, manifest=manifest, record_bytes=len(data), digest=seal_of(data))


# -- the data files against the manifest -----------------------------------------------------


@dataclass(frozen=True)
class FileProblem:
    """A listed data file that is missing (``missing``), of another size (``size``) or cannot
    be examined (``unreadable``: ``cause`` is the store's error)."""

    kind: str
    file: str
    message: str
    byte_range: tuple[int, int]
    keys: tuple[str, ...]
    cause: CheckpointError | None = None

    def error(self, uri: str) -> CheckpointError:
        """The error a reader raises for this problem."""
        if self.cause is not None:
            return self.cause
        return CorruptCheckpointError(
            self.message, path=f"{uri}/{self.file}", byte_range=self.byte_range, key=", ".join(self.keys)
        )


def file_problems(store: Store, manifest: Manifest, keys: KeyIndex | None = None) -> Iterator[FileProblem]:
    """Every listed data file whose size differs from its record, in manifest order (lazily: a
    reader stops at the first, a report collects them all). The sizes come from one listing
    where the store's listing carries them (S3: 1,000 a request, not a ``HEAD`` each;
    :func:`~goodput_ckpt.storage.bulk.file_sizes`)."""
    index = keys
    try:  # one listing where the store's listing has sizes, instead of a request per file
        sizes: dict[str, int | None] = file_sizes(store, manifest.files)
    except CheckpointError:
        sizes = {}  # a file that cannot be examined: found and named below, one at a time
    for f in manifest.files.values():
        where = f"{store.uri}/{f.path}"
        try:
            actual = sizes[f.path] if f.path in sizes else store.size(f.path)
        except CheckpointError as e:
            yield FileProblem("unreadable", f.path, str(e), (0, f.size), (), cause=e)
            continue
        if actual == f.size:
            continue
        index = index or KeyIndex(manifest)
        if actual is None:
            affected = index.keys(f.path, 0, f.size)
            yield FileProblem(
                "missing",
                f.path,
                f"data file {where} ({f.size} bytes) listed in the manifest is missing; keys stored in "
                f"it: {_join(affected)}",
                (0, f.size),
                tuple(affected),
            )
            continue
        lo, hi = sorted((actual, f.size))
        affected = index.keys(f.path, lo, hi)
        yield FileProblem(
            "size",
            f.path,
            f"data file {where} is {actual} bytes but the manifest records {f.size}: it was "
            f"{'truncated' if actual < f.size else 'extended'}; bytes [{lo}, {hi}) are affected "
            f"(keys: {_join(affected) or 'padding only'})",
            (lo, hi),
            tuple(affected),
        )


def _join(keys: list[str], limit: int = 8) -> str:
    if len(keys) <= limit:
        return ", ".join(keys)
    return ", ".join(keys[:limit]) + f" and {len(keys) - limit} more"


# -- chunk digests -----------------------------------------------------------------------------


def bad_chunks(entry: FileEntry, chunk_size: int, start: int, buffers: Iterable[memoryview]) -> list[int]:
    """The indices of the chunks whose blake3 does not match ``entry``'s digests.

    ``buffers`` hold, in order, the file's bytes from ``start`` (a chunk boundary) to a chunk
    boundary or the end of the file. They are consumed one at a time, each completely before
    the next is asked for, so a caller may hand out one reused buffer from a generator (how
    ``verify`` hashes a 1 GiB chunk in bounded memory).
    """
    bad = []
    index = start // chunk_size
    h = blake3.blake3()
    need = min(chunk_size, entry.size - index * chunk_size)  # bytes still owed to chunk ``index``
    for buf in buffers:
        off, n = 0, buf.nbytes
        while off < n:
            if need <= 0:
                raise ValueError(f"bad_chunks: the buffers run past the end of {entry.path!r}")
            take = min(need, n - off)
            h.update(buf[off : off + take])
            off += take
            need -= take
            if need == 0:
                if h.hexdigest() != entry.chunks[index]:
                    bad.append(index)
                index += 1
                h = blake3.blake3()
                need = min(chunk_size, entry.size - index * chunk_size)
    if need != min(chunk_size, entry.size - index * chunk_size):
        raise ValueError(f"bad_chunks: the buffers end inside chunk {index} of {entry.path!r}")
    return bad


def checksum_error(
    uri: str, file: str, lo: int, hi: int, chunk: int, keys: list[str], last_chunk: int | None = None
) -> CorruptCheckpointError:
    """The error for hash chunks ``chunk`` (to ``last_chunk``, bytes ``[lo, hi)``) whose blake3
    does not match the manifest."""
    where = f"{uri}/{file}"
    which = f"chunk {chunk}" if last_chunk is None or last_chunk == chunk else f"chunks {chunk}-{last_chunk}"
    return CorruptCheckpointError(
        f"checksum mismatch in {where}, bytes [{lo}, {hi}) ({which}): the data changed "
        f"after it was written. Affected keys: {_join(keys) or 'padding only'}. Restore an earlier "
        "checkpoint or a replica.",
        path=where,
        byte_range=(lo, hi),
        key=", ".join(keys),
    )


def short_read_error(
    e: IncompleteCheckpointError, keys: str, byte_range: tuple[int, int] | None
) -> CorruptCheckpointError:
    """A data file of a committed checkpoint that ended early or vanished while being read: it
    was damaged after the commit (the store says only that the read came up short)."""
    return CorruptCheckpointError(f"{e} (keys: {keys})", path=e.path, byte_range=byte_range, key=keys)
