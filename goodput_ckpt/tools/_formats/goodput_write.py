"""The goodput format's streaming writer: any converter source to a goodput checkpoint.

The layout (one file per output rank, items aligned as the writer aligns them), the hashing and
the commit are the DCP writer's own (:mod:`goodput_ckpt.engine.hashed_write` and
:mod:`goodput_ckpt.engine.layout`); only the sources differ: here each item's bytes are read from
the input checkpoint when its chunk is written, so memory stays at a few chunks. The reading
side (the goodput format as a converter source) is :mod:`.goodput`, which re-exports the names
here.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..._version import __version__
from ...engine.hashed_write import (
    clear_or_refuse_existing,
    data_file_name,
    publish_manifest,
    remove_stale_files,
    write_hashed_files,
)
from ...engine.layout import Placement, place_items
from ...errors import CheckpointError
from ...format.dcp_metadata import dtype_name
from ...format.manifest import FORMAT_VERSION, ChunkEntry, FileEntry, Manifest, ObjectEntry, TensorEntry
from ...storage import Store
from .._common import NO_PROGRESS, Progress
from .base import Source, TensorMeta, alloc

__all__ = ["WriteSummary", "dim0_regions", "write_goodput"]

#: DCP metadata version recorded when the input had none (torch's current one).
_DCP_VERSION = "1.0.0"


def dim0_regions(meta: TensorMeta, world_size: int) -> list[tuple[int, int, int]]:
    """``(rank, lo, hi)`` rows of dim 0 that each rank holds, split as ``torch.chunk`` does
    (FSDP2's ``Shard(0)``): ``ceil(n / world_size)`` rows per rank, the last ranks possibly
    fewer or none. 0-dim and empty tensors are one region on rank 0."""
    if not meta.shape or meta.numel == 0:
        return [(0, 0, meta.shape[0] if meta.shape else 1)]
    n = meta.shape[0]
    per = math.ceil(n / world_size)
    return [(r, r * per, min(n, (r + 1) * per)) for r in range(world_size) if r * per < n]


class _BufferPool:
    """Chunk-sized buffers, reused from one chunk to the next.

    Why: a fresh 8 MiB buffer per chunk costs a page fault per page and its zeroing, every
    time, and freed blocks linger in malloc's per-thread arenas, so resident memory drifts far
    above the few chunks actually in flight. Small requests are simply allocated.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size, self._keep = size, keep
        self._free: list[memoryview] = []
        self._lock = threading.Lock()  # guards _free: workers take and give concurrently

    def take(self, n: int) -> memoryview:
        if n > self.size or n < self.size // 4:
            return alloc(n)
        with self._lock:
            buf = self._free.pop() if self._free else None
        return (buf if buf is not None else alloc(self.size))[:n]

    def give(self, view: Any) -> None:
        if not isinstance(view, memoryview):
            return
        whole = memoryview(view.obj)
        if whole.nbytes == self.size and not whole.readonly:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(whole)


class _RegionBytes:
    """The bytes of rows ``[lo, hi)`` of a tensor, read from the source on demand."""

    def __init__(self, source: Source, meta: TensorMeta, first: int, nbytes: int, pool: _BufferPool) -> None:
        self.nbytes = nbytes
        self._source = source
        self._meta = meta
        self._first = first  # first element, in the global C order
        self._pool = pool

    def view(self, start: int, end: int) -> memoryview:
        es = self._meta.itemsize
        if start % es or end % es:
            raise CheckpointError(
                f"internal error: byte range [{start}, {end}) splits an element of {self._meta.key!r}"
            )
        buf = self._pool.take(end - start)
        self._source.read_flat(self._meta.key, self._first + start // es, self._first + end // es, buf)
        return buf

    def recycle(self, buf: Any) -> None:
        self._pool.give(buf)

    def release(self) -> None:
        pass


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data
        self.nbytes = len(data)

    def view(self, start: int, end: int) -> memoryview:
        if self._data is None:
            raise CheckpointError("internal error: object bytes used after release")
        return memoryview(self._data)[start:end]

    def release(self) -> None:
        self._data = None


@dataclass
class WriteSummary:
    files: list[str]
    bytes_written: int
    tensors: int
    objects: int
    manifest: Manifest


def write_goodput(
    source: Source,
    store: Store,
    assign: Mapping[str, int | None],
    *,
    world_size: int,
    chunk_size: int,
    thread_count: int,
    overwrite: bool,
    metadata: Mapping[str, Any],
    progress: Progress = NO_PROGRESS,
) -> WriteSummary:
    """Write the items of ``source`` named in ``assign`` as a goodput-format checkpoint at ``store``.

    ``assign[key]`` is ``None`` for a tensor split along dim 0 over ``world_size`` ranks (see
    :func:`dim0_regions`), or the rank whose file holds the whole item. Each rank's items go
    into its own file, in ``assign``'s order, so each rank reads one contiguous region per
    tensor. The commit follows the DCP writer's rules: an existing checkpoint is refused (or,
    with ``overwrite``, its manifest is removed first), the manifest is published last.
    """
    token = secrets.token_hex(6)
    pool = _BufferPool(chunk_size, thread_count + 1)
    sources: list[Any] = []
    rank_items: dict[int, list[int]] = {}
    # What each written item becomes in the manifest: (key, rank, region rows or None).
    written: list[tuple[str, int, tuple[int, int] | None]] = []
    for key, rank in assign.items():
        meta = source.items[key]
        if isinstance(meta, TensorMeta):
            regions = (
                dim0_regions(meta, world_size) if rank is None else [(rank, 0, meta.shape[0] if meta.shape else 1)]
            )
            row = meta.numel // meta.shape[0] if meta.shape and meta.shape[0] else 1
            for r, lo, hi in regions:
                nbytes = (hi - lo) * row * meta.itemsize if meta.numel else 0
                rank_items.setdefault(r, []).append(len(sources))
                sources.append(_RegionBytes(source, meta, lo * row, nbytes, pool))
                written.append((key, r, (lo, hi)))
        else:
            rank_items.setdefault(rank or 0, []).append(len(sources))
            sources.append(_Bytes(source.object_bytes(key)))
            written.append((key, rank or 0, None))
    # Only now, with the plan made and the objects read, touch the destination.
    store.prepare()
    clear_or_refuse_existing(store, overwrite)
    ranks = sorted(rank_items)
    names = [data_file_name(r, 0, token) for r in ranks]
    placements: list[Placement | None] = [None] * len(sources)
    file_sizes = []
    for f, r in enumerate(ranks):
        local, sizes = place_items([sources[i].nbytes for i in rank_items[r]], 1)
        for p in local:
            i = rank_items[r][p.item]
            placements[i] = Placement(i, f, p.offset, p.length)
        file_sizes.append(sizes[0] if sizes else 0)
    progress.start(sum(file_sizes), "write")
    try:
        entries = write_hashed_files(
            store,
            names,
            [p for p in placements if p is not None],
            file_sizes,
            sources,
            chunk_size=chunk_size,
            thread_count=thread_count,
            order=lambda ch: min((s.item for s in ch.segments if s.item >= 0), default=len(sources)),
            on_chunk=progress.advance,
        )
    finally:
        progress.close()
    manifest = _manifest(source, written, placements, names, ranks, entries, world_size, chunk_size, metadata)
    publish_manifest(store, manifest, replace=overwrite)
    remove_stale_files(store, set(names))
    tensors = sum(1 for k in assign if isinstance(source.items[k], TensorMeta))
    return WriteSummary(names, sum(file_sizes), tensors, len(assign) - tensors, manifest)


def _manifest(
    source, written, placements, names, ranks, entries: list[FileEntry], world_size, chunk_size, metadata
) -> Manifest:
    file_of_rank = {r: names[f] for f, r in enumerate(ranks)}
    items: dict[str, TensorEntry | ObjectEntry] = {}
    chunks: dict[str, list[ChunkEntry]] = {}
    for i, (key, rank, rows) in enumerate(written):
        p = placements[i]
        meta = source.items[key]
        if rows is None:
            items[key] = ObjectEntry(key, "torch.save", file_of_rank[rank], p.offset, p.length)
            continue
        lo, hi = rows
        if meta.shape:
            offsets, sizes = (lo,) + (0,) * (len(meta.shape) - 1), (hi - lo,) + tuple(meta.shape[1:])
        else:
            offsets, sizes = (), ()
        chunks.setdefault(key, []).append(ChunkEntry(offsets, sizes, file_of_rank[rank], p.offset, p.length))
        items[key] = None  # keep the order; filled below
    for key in items:
        if items[key] is None:
            meta = source.items[key]
            items[key] = TensorEntry(
                key, dtype_name(meta.dtype, key), tuple(meta.shape), tuple(chunks[key]), meta.requires_grad
            )
    planner_data = None
    if source.planner_data is not None:
        planner_data = {k: list(v) for k, v in source.planner_data.items() if k in items}
    dcp: dict[str, Any] = {
        "version": getattr(source, "dcp_version", None) or _DCP_VERSION,
        "planner_data": planner_data,
        "storage_meta": None,
    }
    int_keys = {k: list(v) for k, v in source.int_keys.items() if planner_data is not None and k in planner_data}
    if int_keys:  # only then: other manifests stay as they were
        dcp["int_keys"] = int_keys
    return Manifest(
        version=FORMAT_VERSION,
        library_version=__version__,
        torch_version=torch.__version__,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        world_size=world_size,
        chunk_size=chunk_size,
        files={e.path: e for e in entries},
        items=items,
        dcp=dcp,
        metadata=dict(metadata),
    )
