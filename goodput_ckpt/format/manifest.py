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

import blake3

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
    "seal_manifest",
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
        return seal_manifest(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))

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


def _check_tiling(shape: tuple[int, ...], chunks: list[ChunkEntry], where: str, key: str) -> None:
    """The chunks of a tensor must tile its shape: no element missing, none stored twice.

    Otherwise a load would leave part of the destination unwritten. Equal volumes plus pairwise
    disjoint boxes make a tiling; the pairwise test sweeps along the dimension with the most
    distinct offsets, so the usual one-dimensional and grid shardings cost about n log n.
    """
    boxes = [(c.offsets, c.sizes) for c in chunks if math.prod(c.sizes)]
    covered, numel = sum(math.prod(s) for _, s in boxes), math.prod(shape)
    if covered != numel:
        raise _Bad(f"{where}: its chunks hold {covered} of its {numel} elements; they must tile the shape", key=key)
    if len(boxes) < 2:
        return
    d = max(range(len(shape)), key=lambda i: len({o[i] for o, _ in boxes}))
    boxes.sort(key=lambda b: b[0][d])
    for i, (o0, s0) in enumerate(boxes):
        for o1, s1 in boxes[i + 1 :]:
            if o1[d] >= o0[d] + s0[d]:
                break
            if all(a < c + t and c < a + s for a, s, c, t in zip(o0, s0, o1, s1)):
                raise _Bad(f"{where}: chunks at offsets {list(o0)} and {list(o1)} overlap", key=key)


_DIGEST_MEMBER = b',"digest":"'


def seal_manifest(body: bytes) -> bytes:
    """Append the manifest's own digest as its last member.

    ``body`` is the serialized JSON object without a digest. The result is the same object
    with a final ``"digest"`` member holding the blake3 (hex) of every byte before the
    ``,"digest":"`` sequence, so a reader can check the manifest's integrity from its raw bytes
    without re-serializing it.
    """
    body = body.rstrip()
    if not body.endswith(b"}") or body[:-1].rstrip().endswith(b"{"):
        raise ValueError("seal_manifest needs a serialized, non-empty JSON object")
    head = body[:-1]
    return head + _DIGEST_MEMBER + blake3.blake3(head).hexdigest().encode() + b'"}'


def _read_seal(data: bytes) -> tuple[int, bool] | None:
    """``(digest_start, matches)`` for a manifest that ends with a digest member of the form
    :func:`seal_manifest` writes, or ``None`` when it does not."""
    text = data.rstrip()
    start = len(text) - len(b'"}') - 64 - len(_DIGEST_MEMBER)
    if start < 0 or text[start : start + len(_DIGEST_MEMBER)] != _DIGEST_MEMBER or not text.endswith(b'"}'):
        return None
    recorded = text[start + len(_DIGEST_MEMBER) : -2]
    return start, recorded == blake3.blake3(text[:start]).hexdigest().encode()


def _check_seal(data: bytes, where_file: str) -> None:
    """Verify the digest written by :func:`seal_manifest` (see docs/format.md)."""
    seal = _read_seal(data)
    if seal is None:
        raise CorruptCheckpointError(
            f"manifest {where_file} does not end with its digest member: it was edited or "
            "truncated by something other than goodput-ckpt",
            path=where_file,
        )
    start, matches = seal
    if not matches:
        raise CorruptCheckpointError(
            f"manifest {where_file} fails its own checksum: the commit record was edited or "
            "damaged; restore an earlier checkpoint",
            path=where_file,
            byte_range=(0, start),
        )


def _refuse_damaged_version(data: bytes, where_file: str, version: Any) -> None:
    """Tell a damaged ``version`` field from a genuinely newer manifest.

    A later version may seal its manifest another way, so an unknown version is normally
    reported as such. But when the bytes end with a digest member of this version's form and
    that digest does not match, the manifest was sealed and then changed: a flipped bit in the
    version digit is damage, not a manifest from the future.
    """
    seal = _read_seal(data)
    if seal is not None and not seal[1]:
        raise CorruptCheckpointError(
            f"manifest {where_file} claims format version {version!r} but fails its own checksum: "
            "the commit record (its version field, or more) was damaged; restore an earlier checkpoint",
            path=where_file,
            byte_range=(0, seal[0]),
        )


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
        _refuse_damaged_version(data, where_file, version)
        raise CheckpointError(
            f"{where_file} has format version {version!r}; this goodput-ckpt reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}. Upgrade goodput-ckpt to read it.",
            path=where_file,
            version=version,
        )
    _check_seal(data, where_file)
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
        if offset % ALIGNMENT:
            raise _Bad(f"{where}: byte offset {offset} is not a multiple of {ALIGNMENT}", key=key)
        ranges.append((file, offset, length, key))
        return file, offset, length

    ranges: list[tuple[str, int, int, str]] = []  # every item's bytes, to refuse overlaps

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
        _check_tiling(shape, chunks, where, key)
        items[key] = TensorEntry(key, dtype, shape, tuple(chunks), requires_grad)
    # A one-digit change to a byte offset must not move an item onto other bytes unnoticed: the
    # digests cover files, not items, so they cannot catch it.
    ranges = sorted((r for r in ranges if r[2]), key=lambda r: (r[0], r[1]))  # empty items hold no bytes
    for (f0, o0, n0, k0), (f1, o1, _, k1) in zip(ranges, ranges[1:]):
        if f0 == f1 and o1 < o0 + n0:
            raise _Bad(f"items {k0!r} and {k1!r} overlap in {f0!r} at byte {o1}", key=f"{k0}, {k1}")

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
