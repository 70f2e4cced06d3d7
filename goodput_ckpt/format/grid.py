"""Compact shardings (format version 2): a tensor split into a regular grid of blocks, stored as one entry.

Why: in v1 every saved chunk is its own manifest entry, so the commit record grows with ranks x
tensors (a 70B model with AdamW on 1,024 ranks: 2.2 M entries, 249 MB). Nearly every real
sharding is a grid: each dimension ``d`` cut into blocks of ``block[d]`` elements, the last one
smaller (torch's chunk rule: ``ceil(n / parts)``, empty blocks dropped). Such a tensor is stored
as its block shape plus *runs*: consecutive cells (in row-major order) whose bytes lie at one
offset, in files whose indices form an arithmetic progression; an FSDP-sharded tensor is one run
(cell ``k`` in file ``first + k``), a handful when uneven blocks shift later offsets.

Tiling and bounds inside the shape hold by construction, so only the runs are checked: file
indices in range, alignment, one byte length per run (cells on the short edge of a dimension
differ), and byte ranges disjoint and inside their files (:func:`check_spans`, which also serves
v1's explicit chunks). None of it expands a grid into its cells as records: the work is a few
operations per run plus a C-speed slice per run over its files.

:class:`GridChunks` is the in-memory form: a read-only sequence of :class:`ChunkEntry`, made on
demand, so every consumer of ``TensorEntry.chunks`` works unchanged, and :meth:`GridChunks.get`
finds the chunk at given offsets in O(dimensions + log runs). No torch here.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .schema import ALIGNMENT, MAX_FILE_BYTES, ChunkEntry

__all__ = ["GridChunks", "GridError", "Span", "check_spans", "parse_grid"]

#: Grid cells one manifest may describe in all: the span check touches each cell's file once
#: (a C-speed slice), about 10 ns a cell; 2**27 cells is 16,384 ranks x 8,192 tensors.
MAX_GRID_CELLS = 1 << 27

Run = tuple[int, int, int, int]  # cells, first file index, file index step, byte offset


class GridError(Exception):
    """A grid entry is malformed, or its byte ranges overlap or leave their files."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _counts(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-s // b) for s, b in zip(shape, block))


class GridChunks(Sequence[ChunkEntry]):
    """A tensor's chunks as a grid of ``block``-shaped cells (row-major) and their runs."""

    __slots__ = ("shape", "block", "esize", "runs", "names", "counts", "_starts", "_n")

    def __init__(
        self, shape: tuple[int, ...], block: tuple[int, ...], esize: int, runs: tuple[Run, ...], names: Sequence[str]
    ) -> None:
        self.shape, self.block, self.esize, self.runs, self.names = shape, block, esize, runs, names
        self.counts = _counts(shape, block)
        # (C-speed sums: a real FSDP2 layout of small tensors has about one run per cell.)
        starts = list(itertools.accumulate(map(operator.itemgetter(0), runs), initial=0))
        self._starts, self._n = starts[:-1], starts[-1]

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """Bytes of all the cells: they tile the shape, so O(dimensions), not O(cells)."""
        return math.prod(self.shape) * self.esize

    def __reduce__(self) -> tuple[type[GridChunks], tuple[Any, ...]]:
        # Pickled as its constructor's arguments (the parsed record goes to a load's ranks
        # pickled: dcp/manifest_share.py); counts and run starts are derived again.
        return type(self), (self.shape, self.block, self.esize, self.runs, self.names)

    def box(self, cell: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Offsets and sizes of cell ``cell`` (row-major)."""
        offsets, sizes = [], []
        for d in range(len(self.shape) - 1, -1, -1):
            cell, i = divmod(cell, self.counts[d])
            o = i * self.block[d]
            offsets.append(o)
            sizes.append(min(self.block[d], self.shape[d] - o))
        return tuple(reversed(offsets)), tuple(reversed(sizes))

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(self._n)))
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(k)
        r = bisect.bisect_right(self._starts, k) - 1
        _, first, step, offset = self.runs[r]
        offsets, sizes = self.box(k)
        return ChunkEntry(
            offsets, sizes, self.names[first + step * (k - self._starts[r])], offset, math.prod(sizes) * self.esize
        )

    def __iter__(self) -> Iterator[ChunkEntry]:
        return (self[k] for k in range(self._n))

    def get(self, offsets: Sequence[int]) -> ChunkEntry | None:
        """The chunk that starts at ``offsets``, or ``None``: O(dimensions + log runs)."""
        if len(offsets) != len(self.shape):
            return None
        cell = 0
        for o, b, c in zip(offsets, self.block, self.counts):
            i, rem = divmod(o, b)
            if rem or not 0 <= i < c:
                return None
            cell = cell * c + i
        return self[cell]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GridChunks):
            return (self.shape, self.block, self.esize, self.runs) == (
                other.shape,
                other.block,
                other.esize,
                other.runs,
            ) and [self.names[r[1]] for r in self.runs] == [other.names[r[1]] for r in other.runs]
        return isinstance(other, Sequence) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash((self.shape, self.block, self.runs))

    def __repr__(self) -> str:
        return f"GridChunks(shape={self.shape}, block={self.block}, cells={self._n}, runs={len(self.runs)})"

    def to_json(self) -> dict[str, Any]:
        return {"block": list(self.block), "runs": [list(r) for r in self.runs]}


def _edge_cells(a: int, b: int, stride: int, count: int) -> int:
    """How many cells in ``[a, b)`` (row-major) have the last index along a dimension whose
    index advances every ``stride`` cells and takes ``count`` values."""
    period = stride * count

    def upto(x: int) -> int:
        return (x // period) * stride + max(0, x % period - (count - 1) * stride)

    return upto(b) - upto(a)


def _uniform(shape: Sequence[int], block: Sequence[int], counts: Sequence[int], first: int, n: int) -> bool:
    """Whether cells ``[first, first + n)`` all have the same sizes (none or all of them on the
    short edge of each dimension that has one). O(dimensions)."""
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] % block[d]:
            edge = _edge_cells(first, first + n, stride, counts[d])
            if edge not in (0, n):
                return False
        stride *= counts[d]
    return True


def parse_grid(
    doc: Any,
    shape: tuple[int, ...],
    esize: int,
    names: Sequence[str],
    key: str,
    budget: list[int],
    batch: Any = None,
) -> GridChunks:
    """Validate a grid entry's own fields (``budget[0]``: cells this manifest may still describe).

    Its byte ranges are checked later, with every other item's, by :func:`check_spans` (fed
    :func:`spans_of`). With ``batch`` (a :class:`~.grid_runs.GridRuns`), runs of the plain
    JSON shape are left to it, which checks every grid's runs of the manifest at once and gives
    their spans; others are checked here (and raise here).

    Raises:
        GridError: a field is malformed or out of range.
    """
    where = f"item {key!r} grid"
    if not isinstance(doc, dict) or not isinstance(doc.get("block"), list) or not isinstance(doc.get("runs"), list):
        raise GridError(f"{where} must be an object with lists 'block' and 'runs'", key)
    block = doc["block"]
    if len(block) != len(shape) or not shape or 0 in shape:
        raise GridError(
            f"{where}: block {block!r:.80} does not fit the shape {list(shape)} (a grid needs elements)", key
        )
    for b, s in zip(block, shape):
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= s:
            raise GridError(f"{where}: block {block!r:.80} is not within the shape {list(shape)}", key)
    block_t = tuple(block)
    counts = _counts(shape, block_t)
    cells = math.prod(counts)
    budget[0] -= cells
    if budget[0] < 0:
        raise GridError(f"{where}: the manifest's grids describe more than {MAX_GRID_CELLS} cells in all", key)
    runs_doc = doc["runs"]
    if batch is not None and batch.plain(runs_doc):  # checked with every other grid's runs
        grid = GridChunks(shape, block_t, esize, tuple(map(tuple, runs_doc)), names)
        batch.add(key, grid)
        return grid
    return GridChunks(shape, block_t, esize, check_runs(runs_doc, shape, block_t, counts, len(names), key), names)


def check_runs(
    runs_doc: list[Any], shape: tuple[int, ...], block: tuple[int, ...], counts: tuple[int, ...], files: int, key: str
) -> tuple[Run, ...]:
    """A grid's runs, each checked (``files``: how many files the manifest lists).

    The reference for :class:`~.grid_runs.GridRuns`, which makes the same checks on a whole
    manifest's runs at once.

    Raises:
        GridError: a run is malformed or out of range (names the item and the run).
    """
    where = f"item {key!r} grid"
    cells = math.prod(counts)
    runs: list[Run] = []
    n = 0
    for i, run in enumerate(runs_doc):
        if not isinstance(run, list) or len(run) != 4:
            raise GridError(f"{where} run {i}: must be 4 integers [cells, file, file_step, offset]", key)
        count, first, step, offset = run
        # (``type() is int``: JSON's integers, not bools; one test each, not a generator per run.)
        if not (type(count) is int and type(first) is int and type(step) is int and type(offset) is int):
            raise GridError(f"{where} run {i}: must be 4 integers [cells, file, file_step, offset]", key)
        if not 1 <= count <= cells - n:
            raise GridError(f"{where} run {i}: {count} cells, but {cells - n} of the grid's {cells} are left", key)
        if first < 0 or step < 1 or first + step * (count - 1) >= files:
            raise GridError(
                f"{where} run {i}: file indices {first} + {step} x k (k < {count}) are not all among the {files} files",
                key,
            )
        if not 0 <= offset <= MAX_FILE_BYTES or offset % ALIGNMENT:
            raise GridError(f"{where} run {i}: byte offset {offset} is not a multiple of {ALIGNMENT} in range", key)
        if count > 1 and not _uniform(shape, block, counts, n, count):
            raise GridError(
                f"{where} run {i}: cells {n}-{n + count - 1} differ in size (a run holds one byte length)", key
            )
        runs.append((count, first, step, offset))
        n += count
    if n != cells:
        raise GridError(f"{where}: its runs hold {n} of the grid's {cells} cells", key)
    return tuple(runs)


Span = tuple[int, int, int, int, int, str]  # byte offset, length, first file, file step, files, key


def spans_of(grid: GridChunks, key: str) -> Iterator[Span]:
    """The byte ranges of ``grid``'s runs, one span per run."""
    n = 0
    for count, first, step, offset in grid.runs:
        _, sizes = grid.box(n)
        yield offset, math.prod(sizes) * grid.esize, first, step, count, key
        n += count


def check_spans(spans: list[Span], names: Sequence[str], sizes: Sequence[int]) -> None:
    """Every byte range lies inside its file and no two overlap.

    Spans are swept in offset order; for each file the end of the last range is kept, so a range
    overlaps another exactly when it starts before that end. A span's files are an arithmetic
    progression, checked and updated as one strided slice of int64 arrays (a grid's run covers up
    to one file per rank: 16,384 at a time, where Python's ``max`` over a list slice cost 10 ns a
    file): O(spans log spans) comparisons plus one C-speed step per (span, file). A span of one
    file (v1's chunks, objects) takes the scalar path, the same comparisons on single elements.

    Where the spans cover few files each (``cells <= EXPAND_FACTOR x spans``: a real FSDP2
    layout of small tensors, about one run per cell), the sweep's Python step per span costs more
    than expanding every span into its files: :func:`_disjoint_expanded` then checks the same
    conditions in a few array operations, and the sweep runs only to name a problem it found.

    Raises:
        GridError: two ranges overlap, or one runs past the end of its file (names the keys).
    """
    if len(spans) >= _EXPAND_MIN_SPANS and _disjoint_expanded(spans, sizes):
        return
    ends = np.zeros(len(names), dtype=np.int64)  # offsets and lengths are at most 2**50: no overflow
    limit = np.asarray(sizes, dtype=np.int64)
    owner = np.full(len(names), -1, dtype=np.int64)  # the span that ends last in each file
    spans.sort(key=lambda s: s[0])
    for i, (offset, length, first, step, count, key) in enumerate(spans):
        if not length:
            continue
        end = offset + length
        if count == 1:
            if ends.item(first) > offset:
                _overlap(spans, names, owner, first, offset, key)
            if limit.item(first) < end:
                _beyond(names, limit, first, offset, end, key)
            ends[first], owner[first] = end, i
            continue
        sl = slice(first, first + step * (count - 1) + 1, step)
        if ends[sl].max() > offset:
            _overlap(spans, names, owner, first + step * int(np.argmax(ends[sl] > offset)), offset, key)
        if limit[sl].min() < end:
            _beyond(names, limit, first + step * int(np.argmax(limit[sl] < end)), offset, end, key)
        ends[sl], owner[sl] = end, i


#: Spans are expanded into one row per (span, file) when that makes at most this many rows per
#: span: a row costs a few array operations' worth of C (tens of ns), a span in the sweep a
#: Python step (about 1 us).
EXPAND_FACTOR = 4
#: Fewer spans than this: the sweep (the arrays' fixed cost is not worth it).
_EXPAND_MIN_SPANS = 64


def _disjoint_expanded(spans: list[Span], sizes: Sequence[int]) -> bool:
    """Whether every span lies inside its files and no two overlap, checked by expanding the
    spans into (file, start, end) rows, sorting them by file and start, and comparing each row
    with the one before it. ``False`` also when the spans cover too many files to expand
    (more than :data:`EXPAND_FACTOR` per span): the caller's sweep decides then."""
    offset, length, first, step, count = (np.array(c, dtype=np.int64) for c in list(zip(*spans))[:5])
    keep = length > 0
    offset, length, first, step, count = offset[keep], length[keep], first[keep], step[keep], count[keep]
    total = int(count.sum())
    if total > EXPAND_FACTOR * len(spans):
        return False
    span = np.repeat(np.arange(len(count)), count)
    k = np.arange(total) - np.repeat(np.cumsum(count) - count, count)  # index within its span
    file = first[span] + step[span] * k
    start = offset[span]
    end = start + length[span]
    if (end > np.asarray(sizes, dtype=np.int64)[file]).any():
        return False
    order = np.lexsort((start, file))
    file, start, end = file[order], start[order], end[order]
    same = file[1:] == file[:-1]
    return not (same & (start[1:] < end[:-1])).any()


def _overlap(spans: list[Span], names: Sequence[str], owner: np.ndarray, f: int, offset: int, key: str) -> None:
    other = spans[int(owner[f])][5]
    raise GridError(f"items {other!r} and {key!r} overlap in {names[f]!r} at byte {offset}", f"{other}, {key}")


def _beyond(names: Sequence[str], limit: np.ndarray, f: int, offset: int, end: int, key: str) -> None:
    raise GridError(
        f"item {key!r}: byte range [{offset}, {end}) lies beyond the end of {names[f]!r} ({int(limit[f])} bytes)", key
    )
