"""The manifest: the JSON commit record of a checkpoint (format v1). No torch here.

The manifest lists every file with its size and the blake3 of each fixed-size chunk, and every
state-dict item with where its bytes live. It is written last; a location without a valid
manifest is incomplete. :func:`parse_manifest` validates *everything* a reader will later trust
(types, ranges, relative paths, byte ranges inside files) before a single data byte is read, so
a hostile manifest yields a clean :class:`CorruptCheckpointError` and never a deep traceback or a
read outside the checkpoint. The spec is ``docs/format.md``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.base import check_relative_name

__all__ = [
    "ALIGNMENT",
    "DTYPE_SIZES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "MANIFEST_NAME",
    "ChunkEntry",
    "FileEntry",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "parse_manifest",
]

FORMAT_NAME = "goodput-ckpt"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"
HASH_ALGORITHM = "blake3"
#: Byte alignment of every item inside a data file (so readers can mmap typed views).
ALIGNMENT = 64

#: Element size in bytes of every dtype the format can carry, by its canonical name (torch's).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}  # fmt: skip

OBJECT_ENCODINGS = ("torch.save",)

# Limits that keep a hostile manifest from making a reader allocate or loop without bound.
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_FILE_BYTES = 1 << 50
MIN_CHUNK_SIZE = 1 << 12
MAX_CHUNK_SIZE = 1 << 30
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class FileEntry:
    """A data file: its size and the blake3 digest (hex) of each chunk, in order."""

    path: str
    size: int
    chunks: tuple[str, ...]


@dataclass(frozen=True)
class ChunkEntry:
    """One saved piece of a tensor: a box of the global tensor and where its bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]
    requires_grad: bool = False
    kind: str = field(default="tensor", init=False)


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor value, stored as bytes in ``encoding`` (``torch.save``: loaded weights_only)."""

    key: str
    encoding: str
    file: str
    offset: int
    length: int
    kind: str = field(default="object", init=False)


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    version: int
    library_version: str
    torch_version: str
    created_at: str
    world_size: int
    chunk_size: int
    files: dict[str, FileEntry]
    items: dict[str, TensorEntry | ObjectEntry]
    dcp: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Serialize (deterministic key order, UTF-8)."""
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "byte_order": "little",
            "hash": {"algorithm": HASH_ALGORITHM, "chunk_size": self.chunk_size},
            "files": {
                f.path: {"size": f.size, "chunks": list(f.chunks)} for f in self.files.values()
            },
            "items": {k: _item_to_json(v) for k, v in self.items.items()},
            "dcp": self.dcp,
            "metadata": self.metadata,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    def tensor_bytes(self) -> int:
        return sum(c.length for e in self.items.values() if isinstance(e, TensorEntry) for c in e.chunks)

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def _item_to_json(e: TensorEntry | ObjectEntry) -> dict[str, Any]:
    if isinstance(e, TensorEntry):
        return {
            "kind": "tensor",
            "dtype": e.dtype,
            "shape": list(e.shape),
            "requires_grad": e.requires_grad,
            "chunks": [
                {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
                 "offset": c.offset, "length": c.length}
                for c in e.chunks
            ],
        }  # fmt: skip
    return {"kind": "object", "encoding": e.encoding, "file": e.file, "offset": e.offset,
            "length": e.length}  # fmt: skip


# -- parsing and validation ------------------------------------------------------------------


class _Bad(Exception):
    """Internal: a validation failure, turned into CorruptCheckpointError with the location."""

    def __init__(self, message: str, key: str | None = None, file: str | None = None):
        super().__init__(message)
        self.key = key
        self.file = file


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


def _int_list(value: Any, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _Bad(f"{where}: {name!r} must be a list of at most {MAX_NDIM} integers")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > MAX_FILE_BYTES:
            raise _Bad(f"{where}: {name!r} holds an invalid dimension {x!r:.40}")
    return tuple(value)


def parse_manifest(data: bytes, *, location: str = "") -> Manifest:
    """Parse and fully validate a manifest.

    Raises:
        CorruptCheckpointError: the bytes are not a valid v1 manifest (names the field).
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
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
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
        raise CheckpointError(
            f"{where_file} has format version {version!r}; this goodput-ckpt reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}. Upgrade goodput-ckpt to read it.",
            path=where_file,
            version=version,
        )
    try:
        return _parse_v1(doc)
    except _Bad as e:
        raise CorruptCheckpointError(
            f"manifest {where_file} is invalid: {e}", path=where_file, key=e.key
        ) from None


def _parse_v1(doc: dict) -> Manifest:
    w = "manifest"
    if doc.get("byte_order", "little") != "little":
        raise _Bad(f"{w}: byte_order {doc.get('byte_order')!r} is not supported")
    hash_doc = _get(doc, "hash", dict, w)
    if hash_doc.get("algorithm") != HASH_ALGORITHM:
        raise _Bad(f"{w}: hash algorithm {hash_doc.get('algorithm')!r} is not {HASH_ALGORITHM!r}")
    chunk_size = _int_in(hash_doc, "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE, "hash")

    files: dict[str, FileEntry] = {}
    for path, fd in _get(doc, "files", dict, w).items():
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
                f"file {path!r}: {len(chunks)} chunk hashes for {size} bytes "
                f"(expected {math.ceil(size / chunk_size)})",
                file=path,
            )
        if not all(isinstance(h, str) and _HEX64.match(h) for h in chunks):
            raise _Bad(f"file {path!r}: chunk hashes must be 64 lowercase hex digits", file=path)
        files[path] = FileEntry(path, size, tuple(chunks))

    def _range(d: dict, where: str, key: str) -> tuple[str, int, int]:
        file = _get(d, "file", str, where)
        if file not in files:
            raise _Bad(f"{where}: refers to file {file!r} which the manifest does not list", key=key)
        offset = _int_in(d, "offset", 0, MAX_FILE_BYTES, where)
        length = _int_in(d, "length", 0, MAX_FILE_BYTES, where)
        if offset + length > files[file].size:
            raise _Bad(
                f"{where}: byte range [{offset}, {offset + length}) lies beyond the end of "
                f"{file!r} ({files[file].size} bytes)",
                key=key,
            )
        return file, offset, length

    items: dict[str, TensorEntry | ObjectEntry] = {}
    for key, it in _get(doc, "items", dict, w).items():
        where = f"item {key!r}"
        if not isinstance(it, dict):
            raise _Bad(f"{where} is not an object", key=key)
        kind = it.get("kind")
        if kind == "object":
            enc = _get(it, "encoding", str, where)
            if enc not in OBJECT_ENCODINGS:
                raise _Bad(f"{where}: unknown object encoding {enc!r}", key=key)
            items[key] = ObjectEntry(key, enc, *_range(it, where, key))
            continue
        if kind != "tensor":
            raise _Bad(f"{where}: unknown item kind {kind!r} (known: tensor, object)", key=key)
        dtype = _get(it, "dtype", str, where)
        if dtype not in DTYPE_SIZES:
            raise _Bad(f"{where}: unknown dtype {dtype!r}", key=key)
        shape = _int_list(it.get("shape"), "shape", where)
        requires_grad = bool(it.get("requires_grad", False))
        chunk_docs = _get(it, "chunks", list, where)
        chunks = []
        for i, cd in enumerate(chunk_docs):
            cw = f"{where} chunk {i}"
            if not isinstance(cd, dict):
                raise _Bad(f"{cw} is not an object", key=key)
            offsets = _int_list(cd.get("offsets"), "offsets", cw)
            sizes = _int_list(cd.get("sizes"), "sizes", cw)
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise _Bad(f"{cw}: offsets/sizes do not match the tensor's {len(shape)} dims", key=key)
            if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                raise _Bad(f"{cw}: box {offsets}+{sizes} exceeds the shape {list(shape)}", key=key)
            file, offset, length = _range(cd, cw, key)
            expected = math.prod(sizes) * DTYPE_SIZES[dtype]
            if length != expected:
                raise _Bad(f"{cw}: length {length} != {expected} bytes for sizes {list(sizes)}", key=key)
            chunks.append(ChunkEntry(offsets, sizes, file, offset, length))
        items[key] = TensorEntry(key, dtype, shape, tuple(chunks), requires_grad)

    dcp = doc.get("dcp", {})
    metadata = doc.get("metadata", {})
    if not isinstance(dcp, dict) or not isinstance(metadata, dict):
        raise _Bad(f"{w}: 'dcp' and 'metadata' must be objects")
    return Manifest(
        version=doc["version"],
        library_version=str(doc.get("library_version", "")),
        torch_version=str(doc.get("torch_version", "")),
        created_at=str(doc.get("created_at", "")),
        world_size=_int_in(doc, "world_size", 1, 1 << 24, w),
        chunk_size=chunk_size,
        files=files,
        items=items,
        dcp=dcp,
        metadata=metadata,
    )
