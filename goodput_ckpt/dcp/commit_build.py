"""The coordinator's commit record, built from DCP's global ``Metadata`` and every rank's write
results: the one code path that ``CheckpointWriter.finish`` runs and that
``benchmarks/bench_scale.py`` measures at thousands of simulated ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from .._version import __version__
from ..errors import CheckpointError
from ..format.dcp_metadata import StoredRange, encode_planner_data, encode_storage_meta, items_from_dcp
from ..format.manifest import FORMAT_VERSION, FileEntry, Manifest

__all__ = ["StoredItem", "build_manifest"]


@dataclass(frozen=True)
class StoredItem(StoredRange):
    """Per-item write result. The first item of each file also carries that file's entry."""

    file_entry: FileEntry | None = None


def build_manifest(
    metadata: Metadata,
    results: list[list[WriteResult]],
    *,
    chunk_size: int,
    created_at: str,
    user_metadata: dict[str, Any],
    version: int = FORMAT_VERSION,
) -> Manifest:
    """The manifest of a save: its files (in rank order) and its items (in DCP's order), in
    format ``version`` (v2: regular shardings as grids; 1 is kept for comparisons and fixtures).

    Raises:
        CheckpointError: a result was not written by :class:`~goodput_ckpt.CheckpointWriter`,
            or an item cannot be stored.
    """
    locations: dict[tuple[str, Any], StoredRange] = {}
    files: dict[str, FileEntry] = {}
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            if not isinstance(sd, StoredItem):
                raise CheckpointError("CheckpointWriter.finish got results it did not write")
            locations[wr.index.fqn, wr.index.offset] = sd
            if sd.file_entry is not None:
                files[sd.file_entry.path] = sd.file_entry
    return Manifest(
        version=version,
        library_version=__version__,
        torch_version=torch.__version__,
        created_at=created_at,
        world_size=max(1, len(results)),
        chunk_size=chunk_size,
        files=files,
        items=items_from_dcp(metadata, locations, tuple(files) if version >= 2 else None),
        dcp={
            "version": getattr(metadata, "version", None),
            "planner_data": encode_planner_data(metadata.planner_data),
            "storage_meta": encode_storage_meta(getattr(metadata, "storage_meta", None)),
        },
        metadata=user_metadata,
    )
