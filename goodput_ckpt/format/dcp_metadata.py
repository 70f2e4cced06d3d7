"""Translate between the manifest and torch DCP's ``Metadata``, without any pickle.

The writer turns DCP's global ``Metadata`` plus every rank's write results into manifest
entries; the reader rebuilds an equivalent ``Metadata`` from the JSON alone.
"""

from __future__ import annotations

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
from .manifest import DTYPE_SIZES, ChunkEntry, Manifest, ObjectEntry, TensorEntry

__all__ = ["StoredRange", "dtype_name", "items_from_dcp", "to_dcp_metadata", "torch_dtype"]


@dataclass(frozen=True)
class StoredRange:
    """Where one saved item's bytes lie: DCP's per-item ``storage_data``."""

    file: str
    offset: int
    length: int


def dtype_name(dtype: torch.dtype, key: str = "") -> str:
    """Canonical manifest name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise CheckpointError(
            f"tensor {key!r} has dtype {dtype}, which format v1 cannot store "
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


def items_from_dcp(
    metadata: Metadata, locations: dict[MetadataIndex, StoredRange]
) -> dict[str, TensorEntry | ObjectEntry]:
    """Manifest items for DCP's global ``metadata`` and the gathered write locations."""
    items: dict[str, TensorEntry | ObjectEntry] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            loc = locations[MetadataIndex(fqn)]
            items[fqn] = ObjectEntry(fqn, "torch.save", loc.file, loc.offset, loc.length)
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"item {fqn!r} has unsupported metadata {type(md).__name__}", key=fqn)
        if md.properties.layout not in (None, torch.strided):
            raise CheckpointError(
                f"tensor {fqn!r} has layout {md.properties.layout}; only dense (strided) tensors "
                "can be saved",
                key=fqn,
            )
        chunks = []
        for ch in md.chunks:
            loc = locations[MetadataIndex(fqn, ch.offsets)]
            chunks.append(ChunkEntry(tuple(ch.offsets), tuple(ch.sizes), loc.file, loc.offset, loc.length))
        items[fqn] = TensorEntry(
            fqn,
            dtype_name(md.properties.dtype, fqn),
            tuple(md.size),
            tuple(chunks),
            bool(md.properties.requires_grad),
        )
    return items


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


def to_dcp_metadata(manifest: Manifest) -> Metadata:
    """Rebuild DCP ``Metadata`` (with :class:`StoredRange` storage data) from a manifest."""
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, StoredRange] = {}
    for key, e in manifest.items.items():
        if isinstance(e, ObjectEntry):
            sd_md[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = StoredRange(e.file, e.offset, e.length)
            continue
        dtype = torch_dtype(e.dtype, key)
        chunks = []
        for c in e.chunks:
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
            storage[MetadataIndex(key, torch.Size(c.offsets))] = StoredRange(c.file, c.offset, c.length)
        sd_md[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=e.requires_grad),
            size=torch.Size(e.shape),
            chunks=chunks,
        )
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
