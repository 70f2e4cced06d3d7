"""The manifest's item entries of a save, from DCP's global ``Metadata`` and every rank's
:class:`~.rank_writes.RankWrites`, in Python work O(ranks + tensors).

How: ranks whose item keys are the same list (one digest each; with FSDP nearly all of them) form
a group; only one rank's keys per group are decoded, and the group's tables are stacked into one
array, so the rows of tensor ``t`` are a slice at ``t``'s position in each group. Each tensor's
rows then go to :func:`~goodput_ckpt.format.grid_detect.grid_from_rows` (numpy); a tensor that is
not a grid, or whose rows do not match DCP's chunk count, is listed chunk by chunk from DCP's
chunk list, as before, with the same checks. The per-chunk work is in numpy, and DCP's chunk
lists are only counted, except for tensors listed explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..errors import CheckpointError
from ..format.dcp_metadata import dtype_name
from ..format.grid_detect import grid_from_rows
from ..format.manifest import DTYPE_SIZES, ChunkEntry, ObjectEntry, TensorEntry
from .rank_writes import FILE, LENGTH, NDIM, OBJECT, OFFSET, RankWrites

__all__ = ["items_from_ranks"]


class _Rows:
    """Every rank's table rows, found by tensor: one stacked array per group of ranks with the
    same key list, and per tensor the (group, position) pairs that hold its rows.

    A group's stack is items x columns x ranks, so that one column of one tensor's rows is
    contiguous: the detector reads each column a few times, and rows strided by a whole rank's
    table (items x 64 bytes) cost a cache miss each."""

    def __init__(self, metadata: Metadata, ranks: Sequence[RankWrites]) -> None:
        index = {fqn: i for i, fqn in enumerate(metadata.state_dict_metadata)}
        groups: dict[bytes, list[int]] = {}
        for r, rw in enumerate(ranks):
            groups.setdefault(rw.keys_digest, []).append(r)
        bases = np.cumsum([0] + [len(rw.files) for rw in ranks], dtype=np.int64)
        self.where: list[list[tuple[int, int]]] = [[] for _ in index]
        self.stacks: list[np.ndarray] = []
        self.ranks: list[np.ndarray] = []
        for members in groups.values():
            tables = [ranks[m].table for m in members]
            first = tables[0]
            if any(t.shape != first.shape for t in tables):
                raise CheckpointError("CheckpointWriter.finish: ranks with the same item keys sent tables of other shapes")
            try:
                keys = ranks[members[0]].key_list()
            except ValueError as e:
                raise CheckpointError(f"CheckpointWriter.finish got results it did not write: {e}") from e
            stack = _stacked(tables)  # items x columns x members
            stack[:, FILE, :] += bases[members]  # rank-local file index -> the manifest's
            g = len(self.stacks)
            self.stacks.append(stack)
            self.ranks.append(np.array(members, dtype=np.int64))
            for p, key in enumerate(keys):
                t = index.get(key)
                if t is not None:  # keys DCP's metadata does not list are ignored, as DCP does
                    self.where[t].append((g, p))

    def of(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Tensor ``t``'s rows by column (columns x n, a common width) and the rank of each."""
        parts = self.where[t]
        if len(parts) == 1:
            g, p = parts[0]
            return self.stacks[g][p], self.ranks[g]
        width = max((self.stacks[g].shape[1] for g, _ in parts), default=4)
        cols = [_widen(self.stacks[g][p], width) for g, p in parts]
        ranks = [self.ranks[g] for g, _ in parts]
        if not cols:
            return np.zeros((width, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(cols, axis=1), np.concatenate(ranks)


#: Members transposed at a time by :func:`_stacked`: their rows of one (item, column) are
#: written as one 2 KB run, and the temporary holds this many tables, not all of them.
_STACK_BLOCK = 256


def _stacked(tables: Sequence[np.ndarray]) -> np.ndarray:
    """``np.stack(tables, axis=2)``, a block of members at a time: stacking along the last axis
    writes every element with a stride of a whole member (a cache miss each; 0.5 s for a 70B
    state at 4,096 ranks), and stacking member-major then transposing all at once doubles the
    peak memory (1.1 GB more at 16,384 ranks)."""
    out = np.empty(tables[0].shape + (len(tables),), dtype=np.int64)
    for s in range(0, len(tables), _STACK_BLOCK):
        out[:, :, s : s + _STACK_BLOCK] = np.stack(tables[s : s + _STACK_BLOCK], axis=0).transpose(1, 2, 0)
    return out


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

    With ``grids`` (format v2), a tensor whose chunks form a grid is stored as one
    :class:`~goodput_ckpt.format.grid.GridChunks`; otherwise (and in v1) its chunks are listed.

    Raises:
        CheckpointError: an item DCP lists was not written by any rank, or cannot be stored.
    """
    rows = _Rows(metadata, ranks)
    items: dict[str, TensorEntry | ObjectEntry] = {}
    for t, (fqn, md) in enumerate(metadata.state_dict_metadata.items()):
        cols, owners = rows.of(t)
        if isinstance(md, BytesStorageMetadata):
            objects = np.flatnonzero(cols[NDIM] == OBJECT)
            if not len(objects):
                raise CheckpointError(f"item {fqn!r} is in DCP's metadata but no rank wrote it", key=fqn)
            row = cols[:, objects[int(np.argmax(owners[objects]))]].tolist()  # the last rank's, as DCP keeps one
            items[fqn] = ObjectEntry(fqn, "torch.save", names[row[FILE]], row[OFFSET], row[LENGTH])
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"item {fqn!r} has unsupported metadata {type(md).__name__}", key=fqn)
        if md.properties.layout not in (None, torch.strided):
            raise CheckpointError(
                f"tensor {fqn!r} has layout {md.properties.layout}; only dense (strided) tensors can be saved", key=fqn
            )
        dtype = dtype_name(md.properties.dtype, fqn)
        shape = tuple(md.size)
        dims, width = len(shape), (cols.shape[0] - 4) // 2
        grid = None
        # A grid only from rows that are exactly DCP's chunks: as many, every one a tensor row of
        # this rank (DCP's chunks themselves are then not walked).
        if grids and cols.shape[1] == len(md.chunks) and dims <= width and (cols[NDIM] == dims).all():
            grid = grid_from_rows(
                shape, DTYPE_SIZES[dtype], cols[FILE], cols[OFFSET], cols[LENGTH],
                cols[4 : 4 + dims].T, cols[4 + width : 4 + width + dims].T, names,
            )  # fmt: skip
        chunks = grid if grid is not None else _explicit(fqn, md, cols, owners, names)
        items[fqn] = TensorEntry(fqn, dtype, shape, chunks, bool(md.properties.requires_grad))
    return items


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
            raise CheckpointError(f"chunk {list(offsets)} of tensor {fqn!r} is in DCP's metadata but no rank wrote it", key=fqn)
        out.append(ChunkEntry(offsets, tuple(ch.sizes), names[loc[0]], loc[1], loc[2]))
    return tuple(out)
