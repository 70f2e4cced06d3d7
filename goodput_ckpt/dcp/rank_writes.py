"""What each rank reports to the coordinator after writing its data: one compact value per rank.

DCP gathers every rank's write results on the coordinator. With one ``WriteResult`` per item that
is ranks x tensors pickled dataclasses (2.2 M for a 70B state with AdamW at 1,024 ranks); even as
plain tuples the coordinator then walks each in Python. Here a rank sends its files, its item keys
once as one JSON blob (with a digest, so the coordinator decodes the keys of only one rank per
distinct key list: with FSDP nearly every rank holds a shard of every tensor, in the same order),
and where its items lie as one int64 array. The coordinator's Python work is then O(ranks +
tensors); the per-item work runs in numpy (:mod:`.commit_build`).

This value lives only between the ranks of one job, never on disk: changing it changes no format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..format.manifest import FileEntry

__all__ = ["FILE", "LENGTH", "NDIM", "OBJECT", "OFFSET", "RankWrites", "Written", "from_table", "layout_of", "rank_writes"]

#: One written item: key, chunk offsets (``None`` for an object), file index in the rank's
#: ``files``, byte offset, length.
Written = tuple[str, tuple[int, ...] | None, int, int, int]

#: Columns of :attr:`RankWrites.table`: file index (in the rank's files), byte offset, byte length,
#: number of dimensions (:data:`OBJECT` for a non-tensor value); then ``D`` chunk offsets and ``D``
#: chunk sizes, zero-padded (``D`` the largest number of dimensions among the rank's items).
FILE, OFFSET, LENGTH, NDIM = 0, 1, 2, 3
OBJECT = -1


@dataclass(frozen=True)
class RankWrites:
    """One rank's write results: its files (names and chunk digests, in file order), its item
    keys (a JSON list, in item order) with their digest, and one table row per item.

    ``layout`` digests the keys and the table (everything of the item entries but file names):
    equal between two saves exactly when the layout is, so the coordinator can reuse the last
    save's entries (:func:`~.commit_build.build_manifest`).
    """

    files: tuple[FileEntry, ...]
    keys: bytes
    keys_digest: bytes
    table: np.ndarray  # int64, items x (4 + 2 D)
    layout: bytes

    @property
    def dims(self) -> int:
        """``D``: how many offset (and size) columns the table has."""
        return (self.table.shape[1] - 4) // 2

    def key_list(self) -> list[str]:
        """The item keys, in table order (decoded on demand: O(the rank's items))."""
        keys = json.loads(self.keys)
        if not isinstance(keys, list) or len(keys) != len(self.table) or not all(isinstance(k, str) for k in keys):
            raise ValueError("RankWrites keys do not match its table")
        return keys


def rank_writes(files: Sequence[FileEntry], written: Sequence[Written], sizes: Sequence[tuple[int, ...] | None]) -> RankWrites:
    """A rank's :class:`RankWrites` from its items (``sizes``: each chunk's sizes, ``None`` for an
    object). O(the rank's items), on the rank."""
    dims = max((len(s) for s in sizes if s is not None), default=0)
    table = np.zeros((len(written), 4 + 2 * dims), dtype=np.int64)
    for row, ((_, offsets, file, offset, length), size) in enumerate(zip(written, sizes)):
        r = table[row]
        r[FILE], r[OFFSET], r[LENGTH] = file, offset, length
        if offsets is None or size is None:
            r[NDIM] = OBJECT
        else:
            r[NDIM] = len(offsets)
            r[4 : 4 + len(offsets)] = offsets
            r[4 + dims : 4 + dims + len(size)] = size
    return from_table(files, [w[0] for w in written], table)


def from_table(files: Sequence[FileEntry], keys: Sequence[str], table: np.ndarray) -> RankWrites:
    """A :class:`RankWrites` from its parts (the rank's table already built)."""
    blob = json.dumps(list(keys), separators=(",", ":")).encode()
    keys_digest = hashlib.blake2b(blob, digest_size=16).digest()
    table = np.ascontiguousarray(table, dtype=np.int64)
    return RankWrites(tuple(files), blob, keys_digest, table, layout_of(keys_digest, table))


def layout_of(keys_digest: bytes, table: np.ndarray) -> bytes:
    """:attr:`RankWrites.layout` for these keys and this table."""
    h = hashlib.blake2b(keys_digest, digest_size=16)
    h.update(repr(table.shape).encode())
    h.update(np.ascontiguousarray(table, dtype=np.int64).tobytes())
    return h.digest()
