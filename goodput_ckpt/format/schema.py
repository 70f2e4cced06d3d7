"""The manifest's schema (format versions 1 and 2): constants, limits and the dataclasses a parsed manifest is.

No torch and no validation here: :mod:`.parse` turns bytes into these records after checking
every field, :mod:`.seal` appends and checks the manifest's own digest, and
:meth:`Manifest.to_json` writes them back. The spec is ``docs/format.md``.

The records use ``__slots__``: a large checkpoint's manifest holds hundreds of thousands of them,
and slots make each a few times smaller than a dict-backed instance (see docs/format.md,
"Limits that bound work", for the memory a parse needs per manifest byte).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .gc_pause import gc_paused
from .seal import seal_manifest

__all__ = [
    "ALIGNMENT",
    "DTYPE_SIZES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "MANIFEST_NAME",
    "REFERENCES_VERSION",
    "ChunkEntry",
    "FileEntry",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
]

FORMAT_NAME = "goodput-ckpt"
#: The format version writers emit (the manifest's ``version``; not the training-state schema
#: of ``state/bundle/meta.py``, a separate number): version 2 stores regular shardings compactly (:mod:`.grid`).
FORMAT_VERSION = 2
#: The version of a manifest that references data files of another location (an incremental
#: save, docs/format.md "References"): version 2 plus the file entries' ``base``. Writers emit it
#: only for such a manifest, so a full save stays readable by every version-2 reader.
REFERENCES_VERSION = 3
#: Versions readers accept; v1 checkpoints stay readable and verifiable.
SUPPORTED_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
HASH_ALGORITHM = "blake3"
#: Byte alignment of every item inside a data file (so readers can mmap typed views).
ALIGNMENT = 64

#: Element size in bytes of every dtype the format can carry, by its canonical name (torch's).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

OBJECT_ENCODINGS = ("torch.save",)

# Limits that keep a hostile manifest from making a reader allocate or loop without bound
# (docs/format.md, "Limits that bound work").
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_FILE_BYTES = 1 << 50
MIN_CHUNK_SIZE = 1 << 12
MAX_CHUNK_SIZE = 1 << 30
MAX_WORLD_SIZE = 1 << 24
#: Deepest state-dict path in ``dcp.planner_data`` (torch rebuilds nested containers from it).
MAX_PLANNER_PATH = 64


T = TypeVar("T")


def _pickled_by_init(cls: type[T]) -> type[T]:
    """Pickle instances of ``cls`` as a call of its constructor with its fields.

    Why: a load's ranks get the parsed manifest from the coordinator pickled
    (``dcp/manifest_share.py``), and a frozen, slotted dataclass pickles its state by name and
    sets each field back through ``object.__setattr__``; at 16,384 ranks a training state's
    record has about 117,000 entries. The constructor's arguments are smaller and quicker.
    """
    names = [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]
    get = operator.attrgetter(*names)
    single = len(names) == 1  # attrgetter of one name gives the value, not a tuple

    def __reduce__(self: T) -> tuple[type[T], tuple[Any, ...]]:
        args = get(self)
        return type(self), (args,) if single else args

    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@_pickled_by_init
@dataclass(frozen=True, slots=True)
class FileEntry:
    """A data file: its size and the blake3 digest (hex) of each chunk, in order.

    ``base``: ``None`` for a file of this location; else the name of the sibling location (same
    parent) that holds it (version 3, an incremental save's reference: :mod:`.references`).
    """

    path: str
    size: int
    chunks: tuple[str, ...]
    base: str | None = None


@_pickled_by_init
@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One saved piece of a tensor: a box of the global tensor and where its bytes lie."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@_pickled_by_init
@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor: its saved chunks are a tuple, or a :class:`~.grid.GridChunks` (format version 2's
    compact grid, a read-only sequence of the same :class:`ChunkEntry` records)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[ChunkEntry]
    requires_grad: bool = False
    kind: str = field(default="tensor", init=False)


@_pickled_by_init
@dataclass(frozen=True, slots=True)
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

    @gc_paused()
    def to_json(self) -> bytes:
        """Serialize (deterministic key order, UTF-8) in format ``version``: v1 lists every
        chunk; v2 writes a grid entry for each tensor whose chunks are a grid over this
        manifest's files, in their order."""
        names = list(self.files)
        grid_ok: dict[int, bool] = {}  # id(grid.names) -> whether it is this file order

        def item(e: TensorEntry | ObjectEntry) -> dict[str, Any]:
            if self.version >= 2 and isinstance(e, TensorEntry) and hasattr(e.chunks, "to_json"):
                ok = grid_ok.get(id(e.chunks.names))
                if ok is None:
                    ok = grid_ok[id(e.chunks.names)] = list(e.chunks.names) == names
                if ok:
                    return {
                        "kind": "tensor",
                        "dtype": e.dtype,
                        "shape": list(e.shape),
                        "requires_grad": e.requires_grad,
                        "grid": e.chunks.to_json(),
                    }
            return _item_to_json(e)

        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "byte_order": "little",
            "hash": {"algorithm": HASH_ALGORITHM, "chunk_size": self.chunk_size},
            "files": {f.path: _file_to_json(f) for f in self.files.values()},
            "items": {k: item(v) for k, v in self.items.items()},
            "dcp": self.dcp,
            "metadata": self.metadata,
        }
        return seal_manifest(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))

    def tensor_bytes(self) -> int:
        """Bytes of every tensor's saved chunks: O(items) for grids (their cells tile the
        shape, :attr:`~.grid.GridChunks.nbytes`), never a record per cell (issue 33)."""
        total = 0
        for e in self.items.values():
            if isinstance(e, TensorEntry):
                nbytes = getattr(e.chunks, "nbytes", None)  # a grid (format/grid.py imports this module)
                total += nbytes if nbytes is not None else sum(c.length for c in e.chunks)
        return total

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def written_bytes(self) -> int:
        """Bytes of the files this location holds (what its save wrote)."""
        return sum(f.size for f in self.files.values() if f.base is None)

    def referenced_bytes(self) -> int:
        """Bytes of the files other locations hold for it (an incremental save's references)."""
        return sum(f.size for f in self.files.values() if f.base is not None)

    def bases(self) -> set[str]:
        """The sibling locations whose files this manifest references (empty: standalone)."""
        return {f.base for f in self.files.values() if f.base is not None}


def _file_to_json(f: FileEntry) -> dict[str, Any]:
    if f.base is None:
        return {"size": f.size, "chunks": list(f.chunks)}
    return {"size": f.size, "chunks": list(f.chunks), "base": f.base}


def _item_to_json(e: TensorEntry | ObjectEntry) -> dict[str, Any]:
    if isinstance(e, TensorEntry):
        return {
            "kind": "tensor",
            "dtype": e.dtype,
            "shape": list(e.shape),
            "requires_grad": e.requires_grad,
            "chunks": [
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": c.file,
                    "offset": c.offset,
                    "length": c.length,
                }
                for c in e.chunks
            ],
        }
    return {"kind": "object", "encoding": e.encoding, "file": e.file, "offset": e.offset, "length": e.length}
