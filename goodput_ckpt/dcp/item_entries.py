"""The manifest's item entries of a save, from DCP's global ``Metadata`` and every rank's
:class:`~.rank_writes.RankWrites`, in Python work O(ranks + tensors).

How: ranks whose shards have the same keys (one digest each; with FSDP nearly all of them) form
a group; only one rank's keys per group are decoded, so the rows of tensor ``t`` are row ``p``
of each member's shard rows, ``p`` being ``t``'s position in the group's key list. A rank's own
items (per-rank state, replicated values: not shards) are a group of one each, so their keys do
not split the ranks' groups. (They still widen a rank's table when they have more dimensions than
its shards, which then groups apart from ranks with narrower tables: correct, but their rows may
come out of cell order and take the per-tensor path.) :func:`~.group_grids.batched_grids` finds the grids of all
tensors of a group at once on those tables as they are (numpy, a block of members at a time);
a tensor it leaves open has its rows gathered (once per group for all such tensors) and goes to
:func:`~goodput_ckpt.format.grid_detect.grid_from_rows`, and one that is not a grid, or whose
rows do not match DCP's chunk count, is listed chunk by chunk from DCP's chunk list, with the
same checks. The per-chunk work is in numpy, and DCP's chunk lists are only counted, except for
tensors listed explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..engine.group_grids import Group, Spec, batched_grids
from ..engine.rank_writes import FILE, LENGTH, NDIM, OBJECT, OFFSET, RankWrites
from ..errors import CheckpointError
from ..format.dcp_metadata import dtype_name
from ..format.grid import GridChunks
from ..format.grid_detect import grid_from_rows
from ..format.manifest import DTYPE_SIZES, ChunkEntry, ObjectEntry, TensorEntry

__all__ = ["items_from_ranks"]


class _Rows:
    """Every rank's table rows, found by tensor: the ranks grouped by the keys of their shards
    (each group's shard rows as they came, rank-major; only the rows of tensors the batched path
    leaves open are gathered side by side, :meth:`gather`), each rank's own items (plain tensors,
    objects) a group of one after them, and per tensor the (group, position) pairs that hold its
    rows."""

    def __init__(self, metadata: Metadata, ranks: Sequence[RankWrites]) -> None:
        index = {fqn: i for i, fqn in enumerate(metadata.state_dict_metadata)}
        for rw in ranks:
            if not 0 <= rw.own <= len(rw.table):
                raise CheckpointError("CheckpointWriter.finish got results it did not write: own items out of range")
        groups: dict[tuple[bytes, int], list[int]] = {}
        for r, rw in enumerate(ranks):
            if rw.own < len(rw.table):
                groups.setdefault((rw.keys_digest, rw.table.shape[1]), []).append(r)
        bases = np.cumsum([0] + [len(rw.files) for rw in ranks], dtype=np.int64)
        self.where: list[list[tuple[int, int]]] = [[] for _ in index]
        self.groups: list[Group] = []
        self.ranks: list[np.ndarray] = []
        self.columns: list[int] = []  # per group: its tables' columns

        def add(members: list[int], tables: list[np.ndarray], keys: Callable[[], list[str]]) -> None:
            if any(t.shape != tables[0].shape for t in tables):
                raise CheckpointError(
                    "CheckpointWriter.finish: ranks with the same item keys sent tables of other shapes"
                )
            try:
                decoded = keys()
            except ValueError as e:
                raise CheckpointError(f"CheckpointWriter.finish got results it did not write: {e}") from e
            g = len(self.groups)
            self.ranks.append(np.array(members, dtype=np.int64))
            self.groups.append(Group(tables, bases[self.ranks[-1]]))
            self.columns.append(tables[0].shape[1])
            for p, key in enumerate(decoded):
                t = index.get(key)
                if t is not None:  # keys DCP's metadata does not list are ignored, as DCP does
                    self.where[t].append((g, p))

        for members in groups.values():
            add(members, [ranks[m].shards for m in members], ranks[members[0]].key_list)
        for r, rw in enumerate(ranks):
            if rw.own:
                add([r], [rw.owned], rw.own_key_list)

    def gather(self, open_tensors: Sequence[int]) -> None:
        """Gather the rows of ``open_tensors`` (those :meth:`of` will be asked for) in each group
        at once: one pass over a group's members, not one per tensor."""
        positions: list[list[int]] = [[] for _ in self.groups]
        for t in open_tensors:
            for g, p in self.where[t]:
                positions[g].append(p)
        for group, ps in zip(self.groups, positions):
            group.gather(ps)

    def of(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Tensor ``t``'s rows by column (columns x n, a common width) and the rank of each:
        O(the tensor's rows) in Python, for objects and tensors the batched path left open."""
        parts = self.where[t]
        width = max((self.columns[g] for g, _ in parts), default=4)
        cols = [_widen(self.groups[g].column(p), width) for g, p in parts]
        ranks = [self.ranks[g] for g, _ in parts]
        if not cols:
            return np.zeros((width, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(cols, axis=1), np.concatenate(ranks)


def _widen(cols: np.ndarray, width: int) -> np.ndarray:
    """``cols`` with ``width`` columns: offsets and sizes padded to the same number of dimensions."""
    if cols.shape[0] == width:
        return cols
    dims, new = (cols.shape[0] - 4) // 2, (width - 4) // 2
    out = np.zeros((width, cols.shape[1]), dtype=np.int64)
    out[:4] = cols[:4]
    out[4 : 4 + dims] = cols[4 : 4 + dims]
    out[4 + new : 4 + new + dims] = cols[4 + dims :]
    return out


def items_from_ranks(
    metadata: Metadata, ranks: Sequence[RankWrites], names: Sequence[str], *, grids: bool
) -> dict[str, TensorEntry | ObjectEntry]:
    """Manifest items for DCP's global ``metadata`` and every rank's writes, in DCP's order.

    With ``grids`` (format version 2), a tensor whose chunks form a grid is stored as one
    :class:`~goodput_ckpt.format.grid.GridChunks`; otherwise (and in v1) its chunks are listed.

    Raises:
        CheckpointError: an item DCP lists was not written by any rank, or cannot be stored.
    """
    rows = _Rows(metadata, ranks)
    entries = list(metadata.state_dict_metadata.items())
    fast = batched_grids(rows.groups, rows.where, [_spec(md) if grids else None for _, md in entries], names)
    rows.gather([t for t, chunks in enumerate(fast) if chunks is None])
    items: dict[str, TensorEntry | ObjectEntry] = {}
    for t, (fqn, md) in enumerate(entries):
        chunks = fast[t]
        if chunks is None:
            cols, owners = rows.of(t)
            if isinstance(md, BytesStorageMetadata):
                objects = np.flatnonzero(cols[NDIM] == OBJECT)
                if not len(objects):
                    raise CheckpointError(f"item {fqn!r} is in DCP's metadata but no rank wrote it", key=fqn)
                row = cols[:, objects[int(np.argmax(owners[objects]))]].tolist()  # the last rank's, as DCP keeps one
                items[fqn] = ObjectEntry(fqn, "torch.save", names[row[FILE]], row[OFFSET], row[LENGTH])
                continue
            chunks = _chunks(fqn, md, cols, owners, names, grids=grids)
        items[fqn] = TensorEntry(
            fqn, dtype_name(md.properties.dtype, fqn), tuple(md.size), chunks, bool(md.properties.requires_grad)
        )
    return items


def _spec(md: object) -> Spec | None:
    """What the batched grid path needs of a dense tensor of a known dtype; ``None`` for
    anything else (which :func:`_chunks` or the object branch then checks, and refuses)."""
    if not isinstance(md, TensorStorageMetadata) or md.properties.layout not in (None, torch.strided):
        return None
    try:
        esize = DTYPE_SIZES[dtype_name(md.properties.dtype, "")]
    except CheckpointError:
        return None
    return Spec(tuple(md.size), esize, len(md.chunks))


def _chunks(
    fqn: str, md: object, cols: np.ndarray, owners: np.ndarray, names: Sequence[str], *, grids: bool
) -> GridChunks | tuple[ChunkEntry, ...]:
    """A tensor's chunks from its rows (columns x n): its grid where :func:`grid_from_rows`
    finds one (with ``grids``), else every chunk DCP lists.

    Raises:
        CheckpointError: the item is not a dense tensor, or a chunk DCP lists was not written.
    """
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"item {fqn!r} has unsupported metadata {type(md).__name__}", key=fqn)
    if md.properties.layout not in (None, torch.strided):
        raise CheckpointError(
            f"tensor {fqn!r} has layout {md.properties.layout}; only dense (strided) tensors can be saved", key=fqn
        )
    dtype = dtype_name(md.properties.dtype, fqn)
    shape = tuple(md.size)
    dims, width = len(shape), (cols.shape[0] - 4) // 2
    # A grid only from rows that are exactly DCP's chunks: as many, every one a tensor row of
    # this rank (DCP's chunks themselves are then not walked).
    if grids and cols.shape[1] == len(md.chunks) and dims <= width and (cols[NDIM] == dims).all():
        grid = grid_from_rows(
            shape,
            DTYPE_SIZES[dtype],
            cols[FILE],
            cols[OFFSET],
            cols[LENGTH],
            cols[4 : 4 + dims].T,
            cols[4 + width : 4 + width + dims].T,
            names,
        )
        if grid is not None:
            return grid
    return _explicit(fqn, md, cols, owners, names)


def _explicit(
    fqn: str, md: TensorStorageMetadata, cols: np.ndarray, owners: np.ndarray, names: Sequence[str]
) -> tuple[ChunkEntry, ...]:
    """Every chunk DCP lists for ``fqn``, where its rank wrote it (the last rank's, when two
    did). O(the tensor's chunks) in Python: only tensors that are not grids come here."""
    width = (cols.shape[0] - 4) // 2
    where: dict[tuple[int, ...], tuple[int, int, int]] = {}
    for row in cols.T[np.argsort(owners, kind="stable")].tolist():
        ndim = row[NDIM]
        if 0 <= ndim <= width:
            where[tuple(row[4 : 4 + ndim])] = (row[FILE], row[OFFSET], row[LENGTH])
    out = []
    for ch in md.chunks:
        offsets = tuple(ch.offsets)
        loc = where.get(offsets)
        if loc is None:
            raise CheckpointError(
                f"chunk {list(offsets)} of tensor {fqn!r} is in DCP's metadata but no rank wrote it", key=fqn
            )
        if not 0 <= loc[0] < len(names):
            raise CheckpointError(
                f"chunk {list(offsets)} of tensor {fqn!r} was written to file {loc[0]}, of {len(names)} written",
                key=fqn,
            )
        out.append(ChunkEntry(offsets, tuple(ch.sizes), names[loc[0]], loc[1], loc[2]))
    return tuple(out)
