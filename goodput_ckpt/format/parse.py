"""Parsing and validating a manifest: bytes in, a :class:`~.schema.Manifest` out, or a clean error.

:func:`parse_manifest` validates *every* field that a later step trusts (types, ranges, relative
paths, byte ranges inside files, chunk tiling, item overlaps, ``dcp.planner_data``, and no NaN or
Infinity anywhere) before a single data byte is read, so a hostile manifest yields a clean
:class:`CorruptCheckpointError` and never a deep traceback, an unbounded allocation or a read
outside the checkpoint; and ``verify``, ``inspect`` and ``dcp.load`` all reach the same verdict,
because this one function decides for all of them. No torch here. The spec is
``docs/format.md``.

Memory: the parsed JSON document is consumed as the records are built (each item's JSON is
dropped once its record exists, and file names are shared with the file table), so a parse peaks
at a small multiple of the manifest's size (docs/format.md, "Limits that bound work").
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.base import check_relative_name
from .gc_pause import gc_paused
from .grid import MAX_GRID_CELLS, GridError, Span, check_spans, parse_grid, spans_of
from .grid_runs import GridRuns
from .nesting import int_keys_problem
from .references import base_problem
from .schema import (
    ALIGNMENT,
    DTYPE_SIZES,
    FORMAT_NAME,
    HASH_ALGORITHM,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    MAX_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_PLANNER_PATH,
    MAX_WORLD_SIZE,
    MIN_CHUNK_SIZE,
    OBJECT_ENCODINGS,
    REFERENCES_VERSION,
    SUPPORTED_VERSIONS,
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from .seal import check_seal, refuse_damaged_version
from .tiling import TilingBudget, TilingError, check_tiling

__all__ = ["parse_manifest"]

#: What a chunk digest is made of: 64 of these (lowercase hex).
_HEX_DIGITS = b"0123456789abcdef"
_DIGEST_LEN = 64


class _Bad(Exception):
    """Internal: a validation failure, turned into CorruptCheckpointError with the location."""

    def __init__(self, message: str, key: str | None = None, file: str | None = None):
        super().__init__(message)
        self.key = key
        self.file = file


def _no_constant(name: str) -> Any:
    # json accepts NaN, Infinity and -Infinity, which are not JSON; a manifest we write never
    # holds them (allow_nan=False), and a later step could trip on them (issue 16, item 13).
    raise ValueError(f"{name} is not a JSON value")


@gc_paused()
def parse_manifest(data: bytes, *, location: str = "") -> Manifest:
    """Parse and fully validate a manifest.

    Raises:
        CorruptCheckpointError: the bytes are not a valid manifest of their version (names
            the field).
        CheckpointError: the manifest is of a version this library does not know (its
            ``version`` attribute says which).
    """
    where_file = f"{location}/{MANIFEST_NAME}" if location else MANIFEST_NAME
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"manifest {where_file} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit",
            path=where_file,
        )
    try:
        # (The decoded text is dropped as soon as the document is built.)
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    # ValueError also covers integers over Python's digit limit (int_max_str_digits).
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"manifest {where_file} is not valid JSON ({e}): the commit record is damaged; "
            "restore an earlier checkpoint",
            path=where_file,
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{where_file} is not a {FORMAT_NAME} manifest (format field is "
            f"{doc.get('format') if isinstance(doc, dict) else None!r})",
            path=where_file,
        )
    version = doc.get("version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        refuse_damaged_version(data, where_file, version)
        raise CheckpointError(
            f"{where_file} has format version {version!r}; this goodput-ckpt reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}. Upgrade goodput-ckpt to read it.",
            path=where_file,
            version=version,
        )
    check_seal(data, where_file)
    try:
        return _parse_body(doc)
    except _Bad as e:
        raise CorruptCheckpointError(f"manifest {where_file} is invalid: {e}", path=where_file, key=e.key) from None


def _get(doc: dict, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise _Bad(f"{where}: field {name!r} is missing")
    value = doc[name]
    if kind is int or kind == (int,):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"{where}: field {name!r} must be an integer, got {value!r:.80}")
    elif not isinstance(value, kind):
        raise _Bad(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    return value


def _int_in(doc: dict, name: str, lo: int, hi: int, where: str) -> int:
    v = _get(doc, name, int, where)
    if not lo <= v <= hi:
        raise _Bad(f"{where}: field {name!r} = {v} is outside [{lo}, {hi}]")
    return v


def _int_list(value: Any, name: str, where: str, shared: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...]:
    """``value`` as a tuple of dimensions; equal tuples are one object (``shared``): a sharded
    model repeats the same shapes and chunk sizes thousands of times."""
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _Bad(f"{where}: {name!r} must be a list of at most {MAX_NDIM} integers")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > MAX_FILE_BYTES:
            raise _Bad(f"{where}: {name!r} holds an invalid dimension {x!r:.40}")
    t = tuple(value)
    return shared.setdefault(t, t)


def _parse_files(doc: dict, chunk_size: int) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    references = doc["version"] >= REFERENCES_VERSION
    for path, fd in _get(doc, "files", dict, "manifest").items():
        try:
            check_relative_name(path)
        except CheckpointError as e:
            raise _Bad(str(e), file=path) from None
        if path == MANIFEST_NAME or not isinstance(fd, dict):
            raise _Bad(f"file entry {path!r} is invalid", file=path)
        size = _int_in(fd, "size", 0, MAX_FILE_BYTES, f"file {path!r}")
        chunks = _get(fd, "chunks", list, f"file {path!r}")
        if len(chunks) != math.ceil(size / chunk_size):
            raise _Bad(
                f"file {path!r}: {len(chunks)} chunk hashes for {size} bytes (expected {math.ceil(size / chunk_size)})",
                file=path,
            )
        if not _hex_digests(chunks):
            raise _Bad(f"file {path!r}: chunk hashes must be {_DIGEST_LEN} lowercase hex digits", file=path)
        base = fd.get("base")
        if base is not None and (not references or base_problem(base) is not None):
            why = base_problem(base) if references else f"needs version {REFERENCES_VERSION}, not {doc['version']}"
            raise _Bad(f"file {path!r}: 'base' {why}", file=path)
        files[path] = FileEntry(path, size, tuple(chunks), base)
    return files


def _hex_digests(chunks: list[Any]) -> bool:
    """Whether every element of ``chunks`` is a string of 64 lowercase hex digits.

    Checked on the whole list at once, at C speed: a 405B state's record holds about 480 k digests,
    and a regular expression per digest took 0.3 s of its parse (ten times this). ``join`` refuses
    a non-string, the lengths come from one ``map``, and deleting every hex digit from the joined
    ASCII bytes must leave nothing.
    """
    try:
        joined = "".join(chunks)
    except TypeError:
        return False
    return (
        set(map(len, chunks)) <= {_DIGEST_LEN}
        and joined.isascii()
        and not joined.encode("ascii").translate(None, _HEX_DIGITS)
    )


class _Ranges:
    """Every item's byte range, checked against its file, to refuse overlaps at the end."""

    def __init__(self, files: dict[str, FileEntry]) -> None:
        self.files = files
        self.names = list(files)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.spans: list[Span] = []
        self.grids = GridRuns(self.names, self.spans)  # their runs: checked together at the end

    def take(self, d: dict, where: str, key: str) -> tuple[str, int, int]:
        file = _get(d, "file", str, where)
        entry = self.files.get(file)
        if entry is None:
            raise _Bad(f"{where}: refers to file {file!r} which the manifest does not list", key=key)
        offset = _int_in(d, "offset", 0, MAX_FILE_BYTES, where)
        length = _int_in(d, "length", 0, MAX_FILE_BYTES, where)
        if offset + length > entry.size:
            raise _Bad(
                f"{where}: byte range [{offset}, {offset + length}) lies beyond the end of "
                f"{file!r} ({entry.size} bytes)",
                key=key,
            )
        if offset % ALIGNMENT:
            raise _Bad(f"{where}: byte offset {offset} is not a multiple of {ALIGNMENT}", key=key)
        if length:  # empty items hold no bytes
            self.spans.append((offset, length, self.index[file], 1, 1, key))
        return entry.path, offset, length  # the file table's name: one string per file, not per chunk

    def check_disjoint(self) -> None:
        # A one-digit change to a byte offset must not move an item onto other bytes unnoticed:
        # the digests cover files, not items, so they cannot catch it.
        try:
            check_spans(self.grids.merged(), self.names, [f.size for f in self.files.values()])
        except GridError as e:
            raise _Bad(str(e), key=e.key) from None


class _Shared:
    """What one parse shares between records: equal tuples, and the tiling budget."""

    def __init__(self) -> None:
        self.tuples: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.budget = TilingBudget()
        self.cells = [MAX_GRID_CELLS]  # what grids may still describe (format version 2)


def _parse_tensor(key: str, it: dict, ranges: _Ranges, shared: _Shared, version: int) -> TensorEntry:
    where = f"item {key!r}"
    dtype = _get(it, "dtype", str, where)
    if dtype not in DTYPE_SIZES:
        raise _Bad(f"{where}: unknown dtype {dtype!r}", key=key)
    shape = _int_list(it.get("shape"), "shape", where, shared.tuples)
    requires_grad = it.get("requires_grad", False)
    if not isinstance(requires_grad, bool):
        raise _Bad(f"{where}: field 'requires_grad' must be true or false", key=key)
    if version >= 2 and "grid" in it:
        if "chunks" in it:
            raise _Bad(f"{where}: holds both 'grid' and 'chunks' (one of them)", key=key)
        try:
            held = len(ranges.grids.grids)
            # Runs of the plain JSON shape are checked with every other grid's at the end
            # (format/grid_runs.py); others here.
            grid = parse_grid(it["grid"], shape, DTYPE_SIZES[dtype], ranges.names, key, shared.cells, ranges.grids)
        except GridError as e:
            raise _Bad(str(e), key=key) from None
        if len(ranges.grids.grids) == held:  # checked here, not batched: its spans now
            ranges.spans.extend(spans_of(grid, key))
        return TensorEntry(key, dtype, shape, grid, requires_grad)
    chunks = []
    chunk_docs = _get(it, "chunks", list, where)
    for i, cd in enumerate(chunk_docs):
        chunk_docs[i] = None  # drop the chunk's JSON once read (peak memory: one tensor may hold many)
        cw = f"{where} chunk {i}"
        if not isinstance(cd, dict):
            raise _Bad(f"{cw} is not an object", key=key)
        offsets = _int_list(cd.get("offsets"), "offsets", cw, shared.tuples)
        sizes = _int_list(cd.get("sizes"), "sizes", cw, shared.tuples)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _Bad(f"{cw}: offsets/sizes do not match the tensor's {len(shape)} dims", key=key)
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise _Bad(f"{cw}: box {offsets}+{sizes} exceeds the shape {list(shape)}", key=key)
        file, offset, length = ranges.take(cd, cw, key)
        expected = math.prod(sizes) * DTYPE_SIZES[dtype]
        if length != expected:
            raise _Bad(f"{cw}: length {length} != {expected} bytes for sizes {list(sizes)}", key=key)
        chunks.append(ChunkEntry(offsets, sizes, file, offset, length))
    try:
        check_tiling(shape, [(c.offsets, c.sizes) for c in chunks], shared.budget)
    except TilingError as e:
        raise _Bad(f"{where}: {e}", key=key) from None
    return TensorEntry(key, dtype, shape, tuple(chunks), requires_grad)


def _parse_items(doc: dict, ranges: _Ranges, version: int) -> dict[str, TensorEntry | ObjectEntry]:
    items: dict[str, TensorEntry | ObjectEntry] = {}
    shared = _Shared()
    items_doc = _get(doc, "items", dict, "manifest")
    for key in items_doc:
        it = items_doc[key]
        items_doc[key] = None  # drop the item's JSON once its record exists (peak memory)
        where = f"item {key!r}"
        if not isinstance(it, dict):
            raise _Bad(f"{where} is not an object", key=key)
        kind = it.get("kind")
        if kind == "object":
            enc = _get(it, "encoding", str, where)
            if enc not in OBJECT_ENCODINGS:
                raise _Bad(f"{where}: unknown object encoding {enc!r}", key=key)
            items[key] = ObjectEntry(key, enc, *ranges.take(it, where, key))
        elif kind == "tensor":
            items[key] = _parse_tensor(key, it, ranges, shared, version)
        else:
            raise _Bad(f"{where}: unknown item kind {kind!r} (known: tensor, object)", key=key)
    return items


def _check_dcp(dcp: dict) -> None:
    """The fields of ``dcp`` that rebuilding DCP ``Metadata`` trusts.

    ``planner_data`` maps each flattened key to its path in the nested state dict, and torch
    rebuilds the containers from it, growing a list to every index it names: an index is
    bounded by the number of entries (a list of n elements flattens to at least n keys, unless
    most of them are empty containers), so a small manifest cannot make a load allocate without
    bound.
    """
    version = dcp.get("version")
    if version is not None and not isinstance(version, str):
        raise _Bad("dcp: field 'version' must be a string")
    storage_meta = dcp.get("storage_meta")
    if storage_meta is not None and not isinstance(storage_meta, dict):
        raise _Bad("dcp: field 'storage_meta' must be an object or null")
    planner_data = dcp.get("planner_data")
    why = int_keys_problem(dcp.get("int_keys"), planner_data)
    if why is not None:
        raise _Bad(f"field dcp.int_keys is malformed: it {why}")
    if planner_data is None:
        return
    if not isinstance(planner_data, dict):
        raise _Bad(f"field dcp.planner_data is malformed: an object is needed, not {type(planner_data).__name__}")
    bound = len(planner_data)
    for key, path in planner_data.items():
        why = planner_path_problem(path, bound)
        if why is not None:
            raise _Bad(f"field dcp.planner_data is malformed: the path of {key!r} {why}", key=key)


def planner_path_problem(path: object, bound: int) -> str | None:
    """What is wrong with one ``planner_data`` path, or ``None``: it must be a list of 1 to
    ``MAX_PLANNER_PATH`` names and list indices, starting with a name, every index below
    ``bound``. The one rule for our manifests and for foreign checkpoints' planner data (see
    :func:`_check_dcp` for why an index is bounded)."""
    if not isinstance(path, (list, tuple)) or not 1 <= len(path) <= MAX_PLANNER_PATH or not isinstance(path[0], str):
        return f"must be a list of 1 to {MAX_PLANNER_PATH} names and indices starting with a name"
    for p in path:
        if isinstance(p, str):
            continue
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < bound:
            return f"holds {p!r:.40}, not a name or a list index below {bound} (the number of entries)"
    return None


def _parse_body(doc: dict) -> Manifest:
    """Everything after the version and the seal; v2 differs from v1 only in grid entries."""
    w = "manifest"
    if doc.get("byte_order", "little") != "little":
        raise _Bad(f"{w}: byte_order {doc.get('byte_order')!r} is not supported")
    hash_doc = _get(doc, "hash", dict, w)
    if hash_doc.get("algorithm") != HASH_ALGORITHM:
        raise _Bad(f"{w}: hash algorithm {hash_doc.get('algorithm')!r} is not {HASH_ALGORITHM!r}")
    chunk_size = _int_in(hash_doc, "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE, "hash")
    files = _parse_files(doc, chunk_size)
    ranges = _Ranges(files)
    items = _parse_items(doc, ranges, doc["version"])
    ranges.check_disjoint()
    dcp = doc.get("dcp", {})
    metadata = doc.get("metadata", {})
    if not isinstance(dcp, dict) or not isinstance(metadata, dict):
        raise _Bad(f"{w}: 'dcp' and 'metadata' must be objects")
    _check_dcp(dcp)
    return Manifest(
        version=doc["version"],
        library_version=str(doc.get("library_version", "")),
        torch_version=str(doc.get("torch_version", "")),
        created_at=str(doc.get("created_at", "")),
        world_size=_int_in(doc, "world_size", 1, MAX_WORLD_SIZE, w),
        chunk_size=chunk_size,
        files=files,
        items=items,
        dcp=dcp,
        metadata=metadata,
    )
