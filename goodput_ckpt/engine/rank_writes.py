"""What each rank reports to the coordinator after writing its data: one compact value per rank.

DCP gathers every rank's write results on the coordinator. With one ``WriteResult`` per item that
is ranks x tensors pickled dataclasses (2.2 M for a 70B state with AdamW at 1,024 ranks); even as
plain tuples the coordinator then walks each in Python. Here a rank sends its files, its item keys
as JSON blobs and where its items lie as one int64 array. The coordinator's Python work is then
O(ranks + tensors); the per-item work runs in numpy (:mod:`.commit_build`).

The keys come in two parts, because the coordinator groups ranks by their keys and decodes the
keys of only one rank per group:

- the rank's **own** items first: values that are not a shard of a distributed tensor (plain
  tensors and objects: per-rank state under keys that name the rank, as training-state schema 1
  saved the RNG and the dataloader, and the small replicated values the save planner leaves on
  the lowest rank). Every rank's are different, and few (the replicated ones: O(tensors) in all,
  on one rank);
- then its **shards**, with a digest of their keys: with FSDP every rank holds a shard of
  nearly every tensor, in the same order, so nearly all ranks share one digest whatever their
  own items are. Were the own keys part of it, a training job's per-rank RNG keys would make
  every rank a group of one, and the coordinator's work O(ranks x tensors) in Python.

This value lives only between the ranks of one job, never on disk: changing it changes no format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..format.manifest import FileEntry

__all__ = [
    "FILE",
    "LENGTH",
    "NDIM",
    "OBJECT",
    "OFFSET",
    "RankWrites",
    "Written",
    "from_table",
    "layout_of",
    "rank_writes",
]

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
    """One rank's write results: its files (names and chunk digests, in file order), one table
    row per item (its ``own`` items first, then its shards), the shards' keys (a JSON list, in
    table order) with their digest, and the own items' keys (a JSON list).

    ``layout`` digests all keys and the table (everything of the item entries but file names):
    equal between two saves exactly when the layout is, so the coordinator can reuse the last
    save's entries (:func:`~.commit_build.build_manifest`).
    """

    files: tuple[FileEntry, ...]
    keys: bytes
    keys_digest: bytes
    table: np.ndarray  # int64, items x (4 + 2 D)
    layout: bytes
    own: int = 0
    own_keys: bytes = b"[]"

    @property
    def dims(self) -> int:
        """``D``: how many offset (and size) columns the table has."""
        return (self.table.shape[1] - 4) // 2

    @property
    def shards(self) -> np.ndarray:
        """The shard rows of the table (a view)."""
        return self.table[self.own :]

    @property
    def owned(self) -> np.ndarray:
        """The own rows of the table (a view)."""
        return self.table[: self.own]

    def key_list(self) -> list[str]:
        """The shards' keys, in table order (decoded on demand: O(the rank's items))."""
        return _decoded(self.keys, len(self.table) - self.own)

    def own_key_list(self) -> list[str]:
        """The own items' keys, in table order."""
        return _decoded(self.own_keys, self.own)


def _decoded(blob: bytes, rows: int) -> list[str]:
    keys = json.loads(blob)
    if not isinstance(keys, list) or len(keys) != rows or not all(isinstance(k, str) for k in keys):
        raise ValueError("RankWrites keys do not match its table")
    return keys


def rank_writes(
    files: Sequence[FileEntry], written: Sequence[Written], sizes: Sequence[tuple[int, ...] | None], *, own: int = 0
) -> RankWrites:
    """A rank's :class:`RankWrites` from its items (``sizes``: each chunk's sizes, ``None`` for an
    object; the first ``own`` items are its own, the rest shards). O(the rank's items), on the
    rank."""
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
    return from_table(files, [w[0] for w in written], table, own=own)


def from_table(files: Sequence[FileEntry], keys: Sequence[str], table: np.ndarray, *, own: int = 0) -> RankWrites:
    """A :class:`RankWrites` from its parts (the rank's table already built; its first ``own``
    rows the rank's own items)."""
    if not 0 <= own <= len(keys):
        raise ValueError(f"own items {own} of {len(keys)}")
    own_blob = _blob(keys[:own])
    blob = _blob(keys[own:])
    keys_digest = hashlib.blake2b(blob, digest_size=16).digest()
    table = np.ascontiguousarray(table, dtype=np.int64)
    return RankWrites(tuple(files), blob, keys_digest, table, layout_of(keys_digest, table, own_blob), own, own_blob)


def _blob(keys: Sequence[str]) -> bytes:
    return json.dumps(list(keys), separators=(",", ":")).encode()


def layout_of(keys_digest: bytes, table: np.ndarray, own_keys: bytes = b"[]") -> bytes:
    """:attr:`RankWrites.layout` for these keys and this table."""
    h = hashlib.blake2b(keys_digest, digest_size=16)
    h.update(hashlib.blake2b(own_keys, digest_size=16).digest())
    h.update(repr(table.shape).encode())
    h.update(np.ascontiguousarray(table, dtype=np.int64).tobytes())
    return h.digest()
