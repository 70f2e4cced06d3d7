"""Every grid entry's runs of one manifest, checked together in numpy instead of run by run.

Why: on a real FSDP2 layout of small tensors a grid is not one run but about one run per cell:
shards of uneven size (and the empty shards of ranks past a tensor's end, which hold no cell)
shift every later item's offset in a rank's file, so the cells of one tensor lie at a different
offset in each file, and the small replicated values the lowest rank keeps shift its file too.
The runs of such a record grow with the ranks (4,800 tensors of 3 to 50 rows: 7,200 runs at 2
ranks, 18,000 at 8), and checking each one in Python (its fields, its cells' sizes, its byte
range) made ``read_metadata`` at 8 ranks twice as costly as at 2 (issue 37, "Restore on a real
layout"; docs/scale.md). Here each grid costs a few Python steps whatever its runs, and the runs
of the whole manifest are checked in a few dozen array operations.

The checks are exactly those of :func:`~.grid.parse_grid`'s run loop, which stays the reference:
when any array check fails, the grids are run through it in manifest order, so a bad record gets
the same error, naming the same item and run, as before. No torch here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .grid import GridChunks, Span, check_runs, spans_of
from .schema import ALIGNMENT, MAX_FILE_BYTES

__all__ = ["GridRuns", "plain_runs"]


def plain_runs(runs: object) -> bool:
    """Whether ``runs`` is a list of 4-element lists of JSON integers (not bools): the shape the
    array checks need, tested at C speed (no Python step per run)."""
    return (
        type(runs) is list
        and set(map(type, runs)) <= {list}
        and set(map(len, runs)) <= {4}
        and set(map(type, itertools.chain.from_iterable(runs))) <= {int}
    )


class GridRuns:
    """The grids of one manifest, added as they are parsed; :meth:`merged` checks all their runs
    at once and returns their byte ranges, with the other items', for :func:`~.grid.check_spans`.

    Args:
        names: the manifest's files, in order (a run's file indices point into it).
        others: the spans of the other items (explicit chunks, objects), which the parse
            appends to in item order.
    """

    def __init__(self, names: Sequence[str], others: list[Span]) -> None:
        self.names = names
        self.others = others
        self.grids: list[tuple[str, GridChunks]] = []
        self.at: list[int] = []

    plain = staticmethod(plain_runs)

    def add(self, key: str, grid: GridChunks) -> None:
        """A grid whose own fields are valid and whose runs passed :func:`plain_runs`."""
        self.grids.append((key, grid))
        self.at.append(len(self.others))  # its spans go after those of the items before it

    def merged(self) -> list[Span]:
        """``others`` with every run's span where its grid's item lies: the order
        :func:`~.grid.check_spans` sweeps ties in, so that a record with several problems is
        refused for the same one as before.

        Raises:
            GridError: a run is invalid (the error :func:`~.grid.check_runs` gives it).
        """
        others = self.others
        if not self.grids:
            return others
        try:
            spans = self._checked()
        except OverflowError:  # an integer beyond int64: out of every range checked
            spans = None
        if spans is None:  # the reference checks, in manifest order: a bad run raises there
            spans = []
            for key, g in self.grids:
                check_runs([list(r) for r in g.runs], g.shape, g.block, g.counts, len(self.names), key)
                spans.extend(spans_of(g, key))
        out: list[Span] = []
        done = taken = 0
        for (_, g), at in zip(self.grids, self.at):
            out.extend(others[done:at])
            out.extend(spans[taken : taken + len(g.runs)])
            done, taken = at, taken + len(g.runs)
        out.extend(others[done:])
        return out

    def _checked(self) -> list[Span] | None:
        grids = [g for _, g in self.grids]
        n_files = len(self.names)
        dims = max(len(g.shape) for g in grids)
        # Per grid, dimensions padded in front with 1s (a size-1 dimension of one cell changes
        # neither the cell order nor any cell's size or byte length).
        pad = [(1,) * (dims - len(g.shape)) for g in grids]
        shape = np.array([p + g.shape for p, g in zip(pad, grids)], dtype=np.int64)
        block = np.array([p + g.block for p, g in zip(pad, grids)], dtype=np.int64)
        counts = np.array([p + g.counts for p, g in zip(pad, grids)], dtype=np.int64)
        cells = np.prod(counts, axis=1)  # what the runs must hold (parse_grid bounded the sum)
        esize = np.array([g.esize for g in grids], dtype=np.int64)
        # A cell's bytes are at most its block's: over MAX_FILE_BYTES, no file holds it (and the
        # products below could overflow int64); the reference path's span check names the file.
        if any(g.esize * _prod(g.block) > MAX_FILE_BYTES for g in grids):
            return None
        nruns = np.array([len(g.runs) for g in grids], dtype=np.int64)
        if (nruns < 1).any():
            return None
        # (Flat: numpy converts a flat list of ints several times faster than one of tuples.)
        flat = list(itertools.chain.from_iterable(itertools.chain.from_iterable(g.runs for g in grids)))
        runs = np.array(flat, dtype=np.int64).reshape(-1, 4)
        gi = np.repeat(np.arange(len(grids)), nruns)
        cnt, first, step, offset = runs[:, 0], runs[:, 1], runs[:, 2], runs[:, 3]
        ok = (cnt >= 1) & (cnt <= cells[gi])
        if not ok.all():
            return None
        # n: the grid's cells before each run (exclusive sum within the grid); bounded by the
        # cells of every grid in all (MAX_GRID_CELLS), so no overflow.
        ends = np.cumsum(cnt)
        before = np.concatenate(([0], ends))[np.concatenate(([0], np.cumsum(nruns)))[:-1]]
        n = ends - cnt - before[gi]
        last_of = np.cumsum(nruns) - 1
        if (n + cnt > cells[gi]).any() or (ends[last_of] - before != cells).any():
            return None
        if ((first < 0) | (first >= n_files) | (step < 1) | ((cnt > 1) & (step >= n_files))).any():
            return None
        if (first + np.minimum(step, n_files) * (cnt - 1) >= n_files).any():
            return None
        if ((offset < 0) | (offset > MAX_FILE_BYTES) | (offset % ALIGNMENT != 0)).any():
            return None
        # The first cell's box (GridChunks.box, by columns) and whether the run's cells are all
        # of its size (grid._uniform, by columns): a run holds one byte length.
        sh, bl, co = shape[gi], block[gi], counts[gi]
        length = esize[gi].copy()
        cell = n.copy()
        stride = np.ones(len(n), dtype=np.int64)
        uniform = np.ones(len(n), dtype=bool)
        for d in range(dims - 1, -1, -1):
            cell, index = np.divmod(cell, co[:, d])
            length *= np.minimum(bl[:, d], sh[:, d] - index * bl[:, d])
            edge = _edge_cells(n, n + cnt, stride, co[:, d])
            uniform &= (sh[:, d] % bl[:, d] == 0) | (edge == 0) | (edge == cnt)
            stride *= co[:, d]
        if not uniform.all():
            return None
        keys = np.array([k for k, _ in self.grids], dtype=object)[gi]
        return list(
            zip(
                offset.tolist(),
                length.tolist(),
                first.tolist(),
                step.tolist(),
                cnt.tolist(),
                keys.tolist(),
                strict=True,
            )
        )


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _edge_cells(a: np.ndarray, b: np.ndarray, stride: np.ndarray, count: np.ndarray) -> np.ndarray:
    """:func:`~.grid._edge_cells` by columns."""
    period = stride * count

    def upto(x: np.ndarray) -> np.ndarray:
        return (x // period) * stride + np.maximum(0, x % period - (count - 1) * stride)

    return upto(b) - upto(a)
