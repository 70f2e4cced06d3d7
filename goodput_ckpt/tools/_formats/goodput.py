"""The goodput format (ours) as a converter source, and its streaming writer.

Reading: every byte is verified against the manifest's blake3 digests before it is used. A
range read that covers whole hash chunks reads them straight into the destination and hashes
them there; chunks that a range only partly covers go through a small :class:`LoadingCache`
of verified chunks, because the neighbouring range (usually being read by another thread)
needs the rest of the same chunk. So each chunk is read and hashed about once.

Writing: the layout (one file per output rank, items aligned as the writer aligns them), the
hashing and the commit are the DCP writer's own (:mod:`goodput_ckpt.engine.hashed_write` and
:mod:`goodput_ckpt.engine.layout`); only the sources differ: here each item's bytes are read from
the input checkpoint when its chunk is written, so memory stays at a few chunks.
"""

from __future__ import annotations

import io
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
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
from ...engine.manifest_load import load_manifest
from ...engine.untrusted_load import check_inflation, weights_only_refusal
from ...errors import CheckpointError, IncompleteCheckpointError
from ...format.commit_record import KeyIndex, bad_chunks, checksum_error, short_read_error
from ...format.dcp_metadata import dtype_name, torch_dtype
from ...format.manifest import FORMAT_VERSION, ChunkEntry, FileEntry, Manifest, ObjectEntry, TensorEntry
from ...format.references import with_references
from ...storage import Store
from .._common import NO_PROGRESS, Progress
from .base import Box, LoadingCache, ObjectMeta, OpenFiles, Source, TensorMeta, alloc

__all__ = ["GoodputSource", "WriteSummary", "dim0_regions", "write_goodput"]

#: DCP metadata version recorded when the input had none (torch's current one).
_DCP_VERSION = "1.0.0"


class _VerifiedRanges:
    """Verified ranged reads of one checkpoint's files (see the module docstring)."""

    def __init__(self, store: Store, manifest: Manifest, *, verify: bool, cache_chunks: int) -> None:
        self._store = store
        self._manifest = manifest
        self._verify = verify
        self._keys = KeyIndex(manifest)
        self._files = OpenFiles(store)
        self._cache = LoadingCache(cache_chunks, self._load_chunk)

    def _fill(self, name: str, offset: int, out: memoryview) -> None:
        try:
            self._files.get(name).read_into(offset, [out])
        except IncompleteCheckpointError as e:  # the file shrank or vanished after the size check
            lo, hi = offset, offset + out.nbytes
            raise short_read_error(e, self._keys.joined(name, lo, hi), (lo, hi)) from e

    def _check(self, name: str, index: int, data: memoryview) -> None:
        cs = self._manifest.chunk_size
        if bad_chunks(self._manifest.files[name], cs, index * cs, [data]):
            lo, hi = index * cs, index * cs + data.nbytes
            raise checksum_error(self._store.uri, name, lo, hi, index, self._keys.keys(name, lo, hi))

    def _load_chunk(self, key: tuple[str, int]) -> memoryview:
        name, index = key
        cs = self._manifest.chunk_size
        size = self._manifest.files[name].size
        buf = alloc(min(cs, size - index * cs))
        self._fill(name, index * cs, buf)
        self._check(name, index, buf)
        return buf

    def read(self, name: str, start: int, end: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, end)`` of file ``name``, every byte verified."""
        if end <= start:
            return
        if not self._verify:
            self._fill(name, start, out)
            return
        cs = self._manifest.chunk_size
        size = self._manifest.files[name].size
        pos = start
        while pos < end:
            index = pos // cs
            c0, c1 = index * cs, min(size, (index + 1) * cs)
            if pos == c0 and end >= c1:
                # A run of whole chunks: read straight into ``out`` and hash in place.
                stop = size if end >= size else end // cs * cs
                self._fill(name, pos, out[pos - start : stop - start])
                for i in range(index, math.ceil(stop / cs)):
                    a, b = i * cs, min(stop, (i + 1) * cs)
                    self._check(name, i, out[a - start : b - start])
                pos = stop
                continue
            chunk = self._cache.get((name, index))
            stop = min(end, c1)
            out[pos - start : stop - start] = chunk[pos - c0 : stop - c0]
            pos = stop

    def close(self) -> None:
        self._files.close()
        self._cache.clear()


class GoodputSource(Source):
    """A committed goodput-format checkpoint, opened for converting or resharding."""

    format = "goodput"

    def __init__(self, store: Store, *, verify: bool = True, trust_pickle: bool = False, cache_chunks: int = 6) -> None:
        super().__init__()
        self.uri = store.uri
        self.manifest = load_manifest(store)
        self.world_size = self.manifest.world_size
        self.trust_pickle = trust_pickle
        # An incremental step's referenced files are read where they live: the output is standalone.
        files = with_references(store, self.manifest)
        self._ranges = _VerifiedRanges(files, self.manifest, verify=verify, cache_chunks=cache_chunks)
        for key, e in self.manifest.items.items():
            if isinstance(e, TensorEntry):
                self.items[key] = TensorMeta(key, torch_dtype(e.dtype, key), e.shape, e.requires_grad)
            else:
                self.items[key] = ObjectMeta(key)
        pd = self.manifest.dcp.get("planner_data")
        self.planner_data = pd if isinstance(pd, dict) else None
        ik = self.manifest.dcp.get("int_keys")  # checked by the manifest parser
        self.int_keys = ik if isinstance(ik, dict) and self.planner_data is not None else {}
        self.metadata = dict(self.manifest.metadata)
        self.dcp_version = (
            self.manifest.dcp.get("version") if isinstance(self.manifest.dcp.get("version"), str) else None
        )

    def boxes(self, key: str) -> list[Box]:
        e = self.manifest.items[key]
        es = torch_dtype(e.dtype, key).itemsize
        return [Box(c.offsets, c.sizes, partial(self._read_chunk, c.file, c.offset, es)) for c in e.chunks]

    def _read_chunk(self, file: str, base: int, es: int, lo: int, hi: int, out: memoryview) -> None:
        self._ranges.read(file, base + lo * es, base + hi * es, out)

    def object_bytes(self, key: str) -> bytes:
        e = self.manifest.items[key]
        buf = bytearray(e.length)
        self._ranges.read(e.file, e.offset, e.offset + e.length, memoryview(buf))
        return bytes(buf)

    def object_value(self, key: str) -> Any:
        return decode_torch_save(self.object_bytes(key), key, self.trust_pickle)

    def close(self) -> None:
        self._ranges.close()


def decode_torch_save(raw: bytes, key: str, trust_pickle: bool) -> Any:
    """Decode a ``torch.save`` value with ``weights_only=True`` unless ``trust_pickle``."""
    check_inflation(raw, f"value {key!r}", key=key)
    try:
        return torch.load(io.BytesIO(raw), weights_only=not trust_pickle, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - the unpickler raises many types
        if trust_pickle:
            raise CheckpointError(f"value {key!r} cannot be decoded: {type(e).__name__}: {e}", key=key) from e
        raise CheckpointError(
            f"value {key!r} cannot be loaded safely with weights_only=True ({weights_only_refusal(e)}). "
            "If you trust this checkpoint, pass --trust-pickle "
            "(trust_pickle=True).",
            key=key,
        ) from None


def encode_torch_save(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# -- writing ------------------------------------------------------------------------------------


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
