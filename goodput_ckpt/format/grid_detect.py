"""Find the grid (format version 2) behind one tensor's saved chunks, given as arrays.

Why arrays: the coordinator of a save builds the commit record from every rank's chunks, ranks x
tensors of them (2.2 M for a 70B state with AdamW at 1,024 ranks, 35 M at 16,384). Walked as
Python tuples that took 13 s at 1,024 ranks. Here a
tensor's chunks are columns of integers and every check is one array operation, so the Python work
is a few dozen calls per tensor (plus one step per run of the result, a handful for real
shardings); the per-chunk work runs in numpy.

It decides exactly as the per-chunk detector it replaced did, and returns the same runs (a test
compares them on random and hostile layouts): chunks without elements are left out; the rest must
be the cells of one grid, each exactly once, each of the size torch's chunk rule gives it, each
holding ``prod(sizes) * esize`` bytes; runs are formed greedily in row-major cell order. Anything
else returns ``None``, and the caller lists the chunks explicitly (whose tiling the parser then
checks). A grid's tiling holds by construction, so a wrongly detected grid would store the wrong
bytes for some cell with nothing left to notice it: every condition above is checked on every
chunk. No torch here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import numpy as np

from .grid import GridChunks, Run

__all__ = ["greedy_runs", "grid_from_rows"]


def grid_from_rows(
    shape: tuple[int, ...],
    esize: int,
    files: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    box_offsets: np.ndarray,
    box_sizes: np.ndarray,
    names: Sequence[str],
) -> GridChunks | None:
    """The grid form of a tensor's chunks, or ``None`` when they are not a grid.

    Args:
        shape, esize: the tensor's shape and element size.
        files, offsets, lengths: per chunk (int64, length n): index into ``names``, byte offset,
            byte length.
        box_offsets, box_sizes: per chunk (int64, n x len(shape)): where the chunk lies.
        names: the manifest's files, in order.
    """
    dims = len(shape)
    if not dims or 0 in shape or box_offsets.ndim != 2 or box_offsets.shape[1] != dims:
        return None
    # Column by column: the coordinator passes each dimension's offsets and sizes as contiguous
    # rows (box_offsets is a transposed view), and 1-D operations on them cost a fraction of
    # the same operations along a 2-D array's short axis (``all(axis=1)`` over 2 values).
    bo = [box_offsets[:, d] for d in range(dims)]
    bs = [box_sizes[:, d] for d in range(dims)]
    full = lengths > 0
    for col in bs:
        full &= col > 0
    if not full.all():
        files, offsets, lengths = files[full], offsets[full], lengths[full]
        bo, bs = [c[full] for c in bo], [c[full] for c in bs]
    n = len(files)
    if not n:
        return None
    block = tuple(int(c.max()) for c in bs)
    if any(b > s for b, s in zip(block, shape)):
        return None
    counts = tuple(-(-s // b) for s, b in zip(shape, block))
    if math.prod(counts) != n:  # Python ints: no overflow however large the counts
        return None
    cell = np.zeros(n, dtype=np.int64)  # row-major cell index; < n once every index is in range
    numel = np.full(n, esize, dtype=np.int64)  # numel of a chunk of a real tensor: < 2**63
    for o, sz, b, s, c in zip(bo, bs, block, shape, counts):
        index, rem = np.divmod(o, b)
        if rem.any() or (o < 0).any() or (index >= c).any():
            return None
        if (sz != np.minimum(b, s - o)).any():
            return None
        cell *= c
        cell += index
        numel *= sz
    if (lengths != numel).any():
        return None
    ramp = np.arange(n)
    if (cell == ramp).all():  # already in cell order (the usual case): no sort, no copies
        f, o, sizes = files, offsets, bs
    else:
        order = np.argsort(cell, kind="stable")
        if not (cell[order] == ramp).all():  # n cells in range, all distinct: each cell once
            return None
        f, o, sizes = files[order], offsets[order], [c[order] for c in bs]
    step = f[1:] - f[:-1]
    # Cell k+1 may follow cell k in a run: same byte offset, the same sizes (a run holds one byte
    # length), a later file.
    link = (o[1:] == o[:-1]) & (step > 0)
    for c in sizes:
        link &= c[1:] == c[:-1]
    # Once a run has two cells its step is fixed: cell k+1 (k >= 1) extends a run that holds
    # cell k - 1 and k exactly when link[k] and step[k] == step[k - 1]; otherwise it breaks.
    breaks = (np.flatnonzero(~(link[1:] & (step[1:] == step[:-1]))) + 1).tolist()
    runs = greedy_runs(n, breaks, lambda k: (int(f[k]), int(o[k])), lambda k: (bool(link[k]), int(step[k])))
    return GridChunks(shape, block, esize, runs, names)


def greedy_runs(
    n: int, breaks: Sequence[int], cell: Callable[[int], tuple[int, int]], link: Callable[[int], tuple[bool, int]]
) -> tuple[Run, ...]:
    """The runs of ``n`` cells in row-major order, formed greedily: the one rule for both grid
    detectors (this module's and the coordinator's batched one, ``engine/group_grids.py``).

    ``cell(k)``: cell ``k``'s file index and byte offset. ``link(k)`` (``k < n - 1``): whether
    cell ``k + 1`` may follow cell ``k`` in a run (same byte offset and sizes, a later file), and
    the file step between them. ``breaks``: sorted, the cells ``k`` (1 <= k <= n - 2) after which
    a run that holds cells ``k - 1`` and ``k`` must end (``link(k)`` false, or another step than
    ``link(k - 1)``'s). Python work is a few steps per run, not per cell.
    """
    runs: list[Run] = []
    s = 0
    while s < n:
        ok, step = link(s) if s < n - 1 else (False, 1)
        file, offset = cell(s)
        if not ok:
            runs.append((1, file, 1, offset))
            s += 1
            continue
        j = bisect.bisect_left(breaks, s + 1)
        e = breaks[j] if j < len(breaks) else n - 1
        runs.append((e - s + 1, file, step, offset))
        s = e + 1
    return tuple(runs)
