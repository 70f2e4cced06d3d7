"""Translate between the manifest and torch DCP's ``Metadata``, without any pickle.

The writer turns DCP's global ``Metadata`` plus every rank's write results into manifest
entries; the reader rebuilds an equivalent ``Metadata`` from the JSON alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointError
from .gc_pause import gc_paused
from .grid import GridChunks
from .manifest import DTYPE_SIZES, ChunkEntry, Manifest, ObjectEntry, TensorEntry

__all__ = ["StoredRange", "dtype_name", "grid_of", "to_dcp_metadata", "torch_dtype"]


@dataclass(frozen=True)
class StoredRange:
    """Where one saved item's bytes lie: DCP's per-item ``storage_data``."""

    file: str
    offset: int
    length: int


#: Names already made: ``str(dtype)`` costs several microseconds, and a commit build at 16,384
#: ranks asks for one per item (each rank's generators are items of their own).
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    """Canonical manifest name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    known = isinstance(dtype, torch.dtype)
    name = _DTYPE_NAMES.get(dtype) if known else None
    if name is not None:
        return name
    name = str(dtype).removeprefix("torch.")
    if known and name in DTYPE_SIZES:
        _DTYPE_NAMES[dtype] = name
    if name not in DTYPE_SIZES:
        raise CheckpointError(
            f"tensor {key!r} has dtype {dtype}, which the goodput format cannot store "
            f"(supported: {', '.join(sorted(DTYPE_SIZES))})",
            key=key or None,
        )
    return name


def torch_dtype(name: str, key: str = "") -> torch.dtype:
    """The torch dtype for a manifest dtype name, if this torch build has it."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(
            f"item {key!r} has dtype {name!r}, which torch {torch.__version__} does not provide; "
            "load it with a newer torch",
            key=key or None,
        )
    return dt


def encode_planner_data(planner_data: Any) -> Any:
    """DefaultSavePlanner's ``planner_data`` (fqn -> path tuple) as JSON; ``None`` otherwise."""
    if not isinstance(planner_data, dict):
        return None
    out = {}
    for k, v in planner_data.items():
        if not isinstance(k, str) or not isinstance(v, (tuple, list)):
            return None
        if not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v):
            return None
        out[k] = list(v)
    return out


def encode_storage_meta(sm: StorageMeta | None) -> dict[str, Any] | None:
    if sm is None:
        return None
    return {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": list(getattr(sm, "modules", []) or []),
    }


class _GridChunkList(Sequence[ChunkStorageMetadata]):
    """A grid's chunks as DCP's ``ChunkStorageMetadata``, made when DCP's planner reads them:
    the rebuild costs nothing per cell, and a rank's planner touches only the tensors it loads."""

    __slots__ = ("_grid", "_made")

    def __init__(self, grid: GridChunks) -> None:
        self._grid = grid
        self._made: list[ChunkStorageMetadata] | None = None

    def _all(self) -> list[ChunkStorageMetadata]:
        # DCP's planner walks a tensor's chunks several times: make them once, when first walked.
        if self._made is None:
            self._made = [
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                for o, s in map(self._grid.box, range(len(self._grid)))
            ]
        return self._made

    def __len__(self) -> int:
        return len(self._grid)

    def __getitem__(self, k: Any) -> Any:
        return self._all()[k]

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self._all())


def grid_of(chunks: Sequence[ChunkStorageMetadata]) -> GridChunks | None:
    """The grid behind a tensor's DCP chunk list when :func:`to_dcp_metadata` made it from a
    format-version-2 grid, else ``None``: a planner can then find the cells a box overlaps by arithmetic
    instead of walking every saved chunk."""
    return chunks._grid if isinstance(chunks, _GridChunkList) else None


class _StorageIndex(Mapping[MetadataIndex, StoredRange]):
    """DCP's ``storage_data`` looked up in the manifest on demand: a grid finds a chunk by
    arithmetic, an explicit chunk list through a per-tensor index built on first use."""

    def __init__(self, manifest: Manifest) -> None:
        self._items = manifest.items
        self._explicit: dict[str, dict[tuple[int, ...], ChunkEntry]] = {}

    def __getitem__(self, index: MetadataIndex) -> StoredRange:
        e = self._items.get(index.fqn)
        if isinstance(e, ObjectEntry):
            return StoredRange(e.file, e.offset, e.length)
        if isinstance(e, TensorEntry):
            offsets = tuple(index.offset or ())
            if isinstance(e.chunks, GridChunks):
                c = e.chunks.get(offsets)
            else:
                table = self._explicit.get(e.key)
                if table is None:
                    table = self._explicit[e.key] = {c.offsets: c for c in e.chunks}
                c = table.get(offsets)
            if c is not None:
                return StoredRange(c.file, c.offset, c.length)
        raise KeyError(index)

    def __iter__(self) -> Iterator[MetadataIndex]:
        for key, e in self._items.items():
            if isinstance(e, ObjectEntry):
                yield MetadataIndex(key)
            else:
                for c in e.chunks:
                    yield MetadataIndex(key, torch.Size(c.offsets))

    def __len__(self) -> int:
        return sum(1 if isinstance(e, ObjectEntry) else len(e.chunks) for e in self._items.values())

    def __bool__(self) -> bool:  # without this, ``storage or {}`` would count every chunk
        return bool(self._items)


@gc_paused()
def to_dcp_metadata(manifest: Manifest) -> Metadata:
    """Rebuild DCP ``Metadata`` (with :class:`StoredRange` storage data) from a manifest.

    Grid tensors (format version 2) cost O(1) here: their chunk lists and storage data are views made
    on demand (O(tensors) in all, not O(chunks)); explicit chunks are listed.
    """
    sd_md: dict[str, Any] = {}
    for key, e in manifest.items.items():
        if isinstance(e, ObjectEntry):
            sd_md[key] = BytesStorageMetadata()
            continue
        dtype = torch_dtype(e.dtype, key)
        if isinstance(e.chunks, GridChunks):
            chunks: Any = _GridChunkList(e.chunks)
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks]
        sd_md[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=e.requires_grad),
            size=torch.Size(e.shape),
            chunks=chunks,
        )
    storage = _StorageIndex(manifest)
    planner_data = manifest.dcp.get("planner_data")  # validated by parse_manifest
    if planner_data is not None:
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    md = Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data=storage)
    sm = manifest.dcp.get("storage_meta")
    if isinstance(sm, dict):
        try:
            md.storage_meta = StorageMeta(
                checkpoint_id=sm.get("checkpoint_id"),
                save_id=str(sm.get("save_id", "")),
                load_id=str(sm.get("load_id", "")),
            )
        except TypeError:
            pass
    version = manifest.dcp.get("version")
    if isinstance(version, str) and hasattr(md, "version"):
        md.version = version
    return md
