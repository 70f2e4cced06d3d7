"""What a rank of a :class:`~goodput_ckpt.CheckpointWriter` save hears from the coordinator and
sends back: its assignment (scattered with the final plan) and its report (gathered with DCP's
write results).

Why: DCP gathers every rank's write results on the coordinator at every save. A full
:class:`~goodput_ckpt.engine.rank_writes.RankWrites` holds a row and a key per item, so the bytes
gathered, unpickled and held grow with ranks x tensors (about 260 KB a rank for a 70B state with
AdamW: 4 GB at 16,384 ranks, docs/scale.md). The coordinator needs those rows only when the
layout changed: from the second save with the same layout on it reuses the last build's item
entries (:mod:`.commit_build`). So the coordinator tells each rank, in its assignment, the layout
digest it holds for it, and a rank whose layout digest equals it sends only its files (names and
chunk hashes: the data's own size, not ranks x tensors) and the digest.

Consistency: the coordinator pins the layouts it announces (:func:`.commit_build.held_layouts`)
and builds this save's record from that pinned snapshot, so another save in the same process
cannot swap it in between. A rank's digest covers its item keys, its table (chunk boxes, files,
offsets, lengths) and each item's dtype, global shape and ``requires_grad``: two saves whose
every rank has the same digest have the same item entries up to file names.

Size: the rows go packed (:class:`PackedWrites`): the table and the keys zlib-compressed, the
keys decompressed once per distinct digest on the coordinator (with FSDP nearly every rank has
the same). The held build keeps the packed form, not the tables (:mod:`.commit_build`): the
coordinator holds about a tenth of the rows' size between saves, and the first save's gathered
payload is that size too (docs/scale.md). Decompression is bounded (:func:`.compact_plan.inflate`).

This value lives only between the ranks of one job, never on disk: changing it changes no format.
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..engine.rank_writes import FILE, RankWrites, Written, rank_writes
from ..errors import CheckpointError
from ..format.manifest import FileEntry
from .compact_plan import MAX_BLOB, inflate

__all__ = [
    "RANK_WRITES_KEY",
    "PackedWrites",
    "RankAssignment",
    "RankReport",
    "pack",
    "rank_report",
    "report_of",
    "unpack",
]

#: zlib level of the packed rows: 1 takes most of what 9 does on int64 tables, far faster.
_LEVEL = 1
#: The widest table a rank may send: 4 columns and 2 x 64 dimensions.
_MAX_COLUMNS = 4 + 2 * 64

#: The index of the one ``WriteResult`` each rank returns (its ``storage_data`` a :class:`RankReport`).
RANK_WRITES_KEY = "__goodput_ckpt_rank_writes__"


@dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank in ``prepare_global_plan``: its index among the
    ranks, this save's token (its file names), and the layout digest the coordinator holds for
    it (``None``: it holds none, send everything)."""

    rank_index: int
    token: str
    known_layout: bytes | None = None


@dataclass(frozen=True)
class PackedWrites:
    """A rank's :class:`RankWrites` without its files (the report holds them), its keys and its
    ``rows x columns`` int64 table zlib-compressed."""

    keys: bytes
    keys_digest: bytes
    own_keys: bytes
    table: bytes
    rows: int
    columns: int
    own: int
    layout: bytes


def pack(writes: RankWrites) -> PackedWrites:
    """``writes`` packed, on the rank: O(its rows)."""
    table = np.ascontiguousarray(writes.table, dtype=np.int64)
    return PackedWrites(
        zlib.compress(writes.keys, _LEVEL),
        writes.keys_digest,
        zlib.compress(writes.own_keys, _LEVEL),
        zlib.compress(table.tobytes(), _LEVEL),
        table.shape[0],
        table.shape[1],
        writes.own,
        writes.layout,
    )


def unpack(
    packed: PackedWrites | RankWrites, files: tuple[FileEntry, ...], rank: int, keys: dict[bytes, bytes]
) -> RankWrites:
    """The :class:`RankWrites` of ``packed`` with ``files``, its shard keys decompressed once per
    digest (``keys``, shared by one build's ranks). A bare :class:`RankWrites` (tests,
    benchmarks) gets ``files`` only.

    Raises:
        CheckpointError: naming the rank, when a size is out of bounds or a blob does not
            decompress to it.
    """
    if isinstance(packed, RankWrites):
        return packed if packed.files == files else replace(packed, files=files)
    if not (0 <= packed.rows and 4 <= packed.columns <= _MAX_COLUMNS and 0 <= packed.own <= packed.rows):
        raise CheckpointError(f"rank {rank}'s write results have a table of {packed.rows} x {packed.columns}")
    size = packed.rows * packed.columns * 8
    if size > MAX_BLOB:
        raise CheckpointError(f"rank {rank}'s write results have a table of {size} bytes, over {MAX_BLOB}")
    raw = inflate(packed.table, size, f"rank {rank}'s write results' table", exact=True)
    table = np.frombuffer(raw, dtype=np.int64).reshape(packed.rows, packed.columns)
    if packed.rows and not (0 <= table[:, FILE].min() and table[:, FILE].max() < len(files)):
        raise CheckpointError(
            f"CheckpointWriter.finish got results it did not write: rank {rank}'s rows name files it did not report"
        )
    shard_keys = keys.get(packed.keys_digest)
    if shard_keys is None:
        shard_keys = keys[packed.keys_digest] = inflate(packed.keys, MAX_BLOB, f"rank {rank}'s write results' keys")
    own_keys = inflate(packed.own_keys, MAX_BLOB, f"rank {rank}'s write results' own keys")
    return RankWrites(files, shard_keys, packed.keys_digest, table, packed.layout, packed.own, own_keys)


@dataclass(frozen=True)
class RankReport:
    """One rank's write results: its files, its layout digest, and its rows (``writes``, packed)
    unless the coordinator announced that it holds this layout (then ``None``)."""

    files: tuple[FileEntry, ...]
    layout: bytes
    writes: PackedWrites | RankWrites | None


def _layout(writes: RankWrites, items: Sequence[WriteItem]) -> bytes:
    """The rank's digest: its :attr:`RankWrites.layout` and its items' dtype, global shape,
    tensor layout and ``requires_grad`` (what the item entries take from DCP's ``Metadata``
    besides the chunks). O(the rank's items), on the rank."""
    props = [
        None
        if it.tensor_data is None
        else (
            str(it.tensor_data.properties.dtype),
            tuple(it.tensor_data.size),
            str(it.tensor_data.properties.layout),
            bool(it.tensor_data.properties.requires_grad),
        )
        for it in items
    ]
    h = hashlib.blake2b(writes.layout, digest_size=16)
    h.update(pickle.dumps(props, protocol=pickle.HIGHEST_PROTOCOL))
    return h.digest()


def rank_report(
    files: Sequence[FileEntry],
    written: Sequence[Written],
    items: Sequence[WriteItem],
    *,
    own: int,
    assignment: RankAssignment,
) -> list[WriteResult]:
    """What ``CheckpointWriter.write_data`` returns: one ``WriteResult`` whose ``storage_data``
    is this rank's :class:`RankReport`, its rows left out when ``assignment`` says the
    coordinator holds its layout. ``written[i]`` is where ``items[i]`` lies (the first ``own``
    items not shards)."""
    files = tuple(files)  # one object, pickled once though the report and its rows both hold it
    boxes = [None if it.tensor_data is None else tuple(it.tensor_data.chunk.sizes) for it in items]
    writes = rank_writes(files, written, boxes, own=own)
    layout = _layout(writes, items)
    report = RankReport(files, layout, None if layout == assignment.known_layout else pack(writes))
    size = sum(f.size for f in files if f.base is None)  # bytes this rank wrote
    return [WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=size, storage_data=report)]


def report_of(results: list[WriteResult]) -> RankReport | None:
    """The :class:`RankReport` of one rank's results; a bare :class:`RankWrites` (built by tests
    and benchmarks) is a report with every row, its layout digest the table's. ``None``: not
    written by :class:`~goodput_ckpt.CheckpointWriter`."""
    if len(results) != 1:
        return None
    data = results[0].storage_data
    if isinstance(data, RankWrites):
        return RankReport(data.files, data.layout, data)
    if isinstance(data, RankReport) and (
        data.writes is None or isinstance(data.writes, PackedWrites) or data.writes.files == data.files
    ):
        return data
    return None
