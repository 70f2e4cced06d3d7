"""grid_from_rows (format v2's grid detection over arrays, what the coordinator runs at every
first save) against the per-chunk detector it replaced, kept here as the oracle: the same grid,
the same runs, or the same refusal, on regular, uneven and deliberately broken layouts. A grid
detected where the chunks are not exactly its cells would store wrong bytes with nothing left to
catch it, so the broken layouts are the point."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from goodput_ckpt.format.grid import GridChunks, _counts, _uniform
from goodput_ckpt.format.grid_detect import grid_from_rows

Chunk = tuple[tuple[int, ...], tuple[int, ...], str, int, int]


def oracle(
    shape: tuple[int, ...], esize: int, chunks: Sequence[Chunk], file_index: dict[str, int], names: Sequence[str]
) -> GridChunks | None:
    """The per-chunk detector as it was in goodput_ckpt/format/grid.py (grid_from_chunks)."""
    if not shape or 0 in shape:
        return None
    full = [c for c in chunks if c[4] and all(c[1])]
    if not full:
        return None
    block = tuple(max(c[1][d] for c in full) for d in range(len(shape)))
    counts = _counts(shape, block)
    cells = math.prod(counts)
    if cells != len(full):
        return None
    where: list[tuple[int, int] | None] = [None] * cells
    for offsets, sizes, file, offset, length in full:
        cell = 0
        for d, (o, s) in enumerate(zip(offsets, sizes)):
            i, rem = divmod(o, block[d])
            if rem or s != min(block[d], shape[d] - o):
                return None
            cell = cell * counts[d] + i
        if where[cell] is not None or length != math.prod(sizes) * esize:
            return None
        where[cell] = (file_index[file], offset)
    runs: list[list[int]] = []
    for cell, (f, offset) in enumerate(where):  # type: ignore[misc]
        if runs:
            r = runs[-1]
            step = f - r[1] if r[0] == 1 else r[2]
            if (
                offset == r[3]
                and step > 0
                and f == r[1] + step * r[0]
                and _uniform(shape, block, counts, cell - r[0], r[0] + 1)
            ):
                r[0] += 1
                r[2] = step
                continue
        runs.append([1, f, 1, offset])
    return GridChunks(shape, block, esize, tuple(tuple(r) for r in runs), names)  # type: ignore[misc]


def detect(shape: tuple[int, ...], esize: int, chunks: Sequence[Chunk], names: Sequence[str]) -> GridChunks | None:
    index = {n: i for i, n in enumerate(names)}
    d = len(shape)
    return grid_from_rows(
        shape,
        esize,
        np.array([index[c[2]] for c in chunks], dtype=np.int64).reshape(-1),
        np.array([c[3] for c in chunks], dtype=np.int64).reshape(-1),
        np.array([c[4] for c in chunks], dtype=np.int64).reshape(-1),
        np.array([c[0] for c in chunks], dtype=np.int64).reshape(-1, d),
        np.array([c[1] for c in chunks], dtype=np.int64).reshape(-1, d),
        names,
    )


def same(shape: tuple[int, ...], esize: int, chunks: Sequence[Chunk], names: Sequence[str]) -> GridChunks | None:
    want = oracle(shape, esize, chunks, {n: i for i, n in enumerate(names)}, names)
    got = detect(shape, esize, chunks, names)
    if want is None:
        assert got is None, (shape, chunks, got)
    else:
        assert got is not None, (shape, chunks)
        assert (got.block, got.runs) == (want.block, want.runs)
    return got


def split(n: int, parts: int) -> list[tuple[int, int]]:
    c = -(-n // parts)
    return [(o, min(c, n - o)) for o in range(0, n, c)]


def grid_chunks(shape: tuple[int, ...], parts: tuple[int, ...], esize: int, file_of, offset_of) -> list[Chunk]:
    """The cells of ``shape`` split by torch's chunk rule into ``parts`` per dimension."""
    axes = [split(s, p) for s, p in zip(shape, parts)]
    out: list[Chunk] = []
    for k, cell in enumerate(np.ndindex(*[len(a) for a in axes])):
        offsets = tuple(axes[d][i][0] for d, i in enumerate(cell))
        sizes = tuple(axes[d][i][1] for d, i in enumerate(cell))
        out.append((offsets, sizes, file_of(k), offset_of(k, sizes), math.prod(sizes) * esize))
    return out


NAMES = [f"f{i}" for i in range(400)]


def test_fsdp_even_is_one_run():
    g = same((64, 8), 4, grid_chunks((64, 8), (16, 1), 4, lambda k: NAMES[k], lambda k, s: 128), NAMES)
    assert g is not None and g.runs == ((16, 0, 1, 128),)


def test_uneven_last_shard_is_a_run_of_its_own():
    g = same((10, 3), 2, grid_chunks((10, 3), (4, 1), 2, lambda k: NAMES[k], lambda k, s: 0), NAMES)
    assert g is not None and g.block == (3, 3) and [r[0] for r in g.runs] == [3, 1]


def test_fsdp_x_tp_2d_grid():
    # FSDP over dim 0 (4), TP over dim 1 (8): rank i * 8 + j holds cell (i, j)
    g = same((40, 20), 2, grid_chunks((40, 20), (4, 8), 2, lambda k: NAMES[k], lambda k, s: 512), NAMES)
    assert g is not None and g.block == (10, 3)


def test_replicated_chunk_twice_is_not_a_grid():
    chunks = grid_chunks((8, 2), (4, 1), 4, lambda k: NAMES[k], lambda k, s: 0)
    assert same((8, 2), 4, chunks + [chunks[1][:2] + ("f9", 0, chunks[1][4])], NAMES) is None


def test_a_rank_with_no_shard_is_left_out():
    chunks = grid_chunks((3, 2), (3, 1), 4, lambda k: NAMES[k], lambda k, s: 0)
    empty = ((3, 0), (0, 2), "f7", 0, 0)  # a rank past the end: torch's empty chunk
    assert same((3, 2), 4, [*chunks, empty], NAMES) is not None


def short(c: Chunk, d: int = 1) -> Chunk:
    """``c`` one element shorter along ``d``, its byte length to match."""
    sizes = c[1][:d] + (c[1][d] - 1,) + c[1][d + 1 :]
    return (c[0], sizes, c[2], c[3], math.prod(sizes) * c[4] // math.prod(c[1]))


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c[:-1],  # a cell missing
        lambda c: c[:1] + c,  # a cell twice, another missing
        lambda c: [((c[0][0][0] + 1,) + c[0][0][1:], *c[0][1:])] + c[1:],  # an offset off the grid
        lambda c: [(c[0][0], (c[0][1][0] - 1,) + c[0][1][1:], *c[0][2:])] + c[1:],  # a short cell
        lambda c: [short(c[0])] + c[1:],  # a short cell holding its own bytes: elements unstored
        lambda c: c[:-1] + [short(c[-1], 0)],  # the same on the grid's edge, along dim 0
        lambda c: [(*c[0][:4], c[0][4] + 2)] + c[1:],  # wrong byte length
        lambda c: [((-c[1][1][0],) + c[1][0][1:], *c[1][1:])] + c[1:],  # negative offset
    ],
)
def test_broken_layouts_are_not_grids(break_it):
    chunks = grid_chunks((12, 4), (4, 2), 2, lambda k: NAMES[k], lambda k, s: 64)
    assert same((12, 4), 2, break_it(list(chunks)), NAMES) is None


def test_random_layouts_match_the_oracle():
    rng = random.Random(19)
    grids = 0
    for _ in range(3000):
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 9) for _ in range(dims))
        parts = tuple(rng.randint(1, s + 1) for s in shape)
        esize = rng.choice((1, 2, 4))
        mode = rng.randrange(5)
        files = list(range(len(NAMES)))
        if mode == 1:
            rng.shuffle(files)
        step = rng.choice((1, 2, 3))
        chunks = grid_chunks(
            shape,
            parts,
            esize,
            lambda k: NAMES[files[(k * step) % len(NAMES)]],
            lambda k, s: (64 * rng.randrange(3)) if mode == 2 else 64 * (math.prod(s) != max(1, 1)),
        )
        if mode == 3 and chunks:
            i = rng.randrange(len(chunks))
            o, s, f, off, n = chunks[i]
            d = rng.randrange(dims)
            tweak = rng.choice(("offset", "size", "length", "drop", "dup"))
            if tweak == "offset":
                chunks[i] = (o[:d] + (o[d] + rng.choice((-1, 1)),) + o[d + 1 :], s, f, off, n)
            elif tweak == "size":
                sizes = s[:d] + (s[d] + rng.choice((-1, 1)),) + s[d + 1 :]
                chunks[i] = (o, sizes, f, off, math.prod(sizes) * esize if rng.random() < 0.7 else n)
            elif tweak == "length":
                chunks[i] = (o, s, f, off, n + esize)
            elif tweak == "drop":
                chunks.pop(i)
            else:
                chunks.append(chunks[i])
        if mode == 4:
            rng.shuffle(chunks)
        if chunks and any(min(c[0]) < 0 for c in chunks):
            assert detect(shape, esize, chunks, NAMES) is None  # the oracle indexed negative cells
            continue
        if chunks:
            grids += same(shape, esize, chunks, NAMES) is not None
    assert grids > 1000  # the regular cases were grids
