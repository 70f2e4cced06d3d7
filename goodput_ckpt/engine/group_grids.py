"""Grid detection (format version 2) for every tensor of a save at once, on the ranks' own tables.

Why: at 16,384 ranks a 70B state with AdamW has 17 M rows (1.1 GB of tables). Detecting each
tensor's grid on its own needs its rows side by side, so every table used to be transposed into
one new array (items x columns x ranks: 1.1 GB written with a stride, and as many fresh pages
faulted in), then about a dozen passes ran per tensor: 0.9-1.5 s of the first save's build.

How: within a group of ranks (:class:`Group`: the shard rows of ranks whose shard keys and
table width are the same, or one rank's own items), tensor ``p``'s rows are row ``p`` of each
member's table, in member (rank) order, and in a regular grid two consecutive members' rows
differ by a constant: the file index by the run's step, the split dimension's offset by the
block, nothing else. So a block of members is copied, rank-major as it is, into a reused buffer
(no transposition, no fresh memory), differenced along the members in one pass and compared
with that expected difference, for every tensor of the group at once. A pair of rows that
differs ("irregular": a run's end, the short last cell, a group's boundary, a shifted offset) is
examined on its own in Python, as is every row after one, the first row of each part and the
tensor's last (anchors, checked in full against the cell their index names). Every other row is
valid because its predecessor is and it differs from it as the grid says (induction along the
members), and it links to it in the same run.

What it accepts is what :func:`~goodput_ckpt.format.grid_detect.grid_from_rows` accepts, with the
same runs (``tests/engine/test_group_grids.py`` compares them): for a tensor split along at most one
dimension whose rows come in cell order and are exactly DCP's chunks. For anything else (a grid
split along two dimensions, rows out of order, empty chunks, more irregular pairs than
:func:`_irregular_cap`) it answers ``None`` and the caller runs ``grid_from_rows``, which decides.
No torch here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..format.grid import GridChunks
from ..format.grid_detect import greedy_runs
from .rank_writes import FILE, LENGTH, NDIM, OFFSET

__all__ = ["Group", "Spec", "batched_grids"]

#: int64 elements of one block of members (4 MiB; with its differences and their comparison
#: about 8.5 MiB of buffers, more when one member's table is larger): the buffers are reused,
#: so no fresh page is touched after the first block.
_BLOCK_ELEMENTS = 1 << 19


def _irregular_cap(n: int) -> int:
    """Irregular pairs a tensor of ``n`` rows may have here: each costs a few microseconds of
    Python, against one numpy element in ``grid_from_rows``; a real sharding has a handful."""
    return 16 + n // 256


#: Members up to which a group's rows are gathered for the per-tensor path by one stacked copy
#: of all of them (items x columns x members, made once): a group of one rank (rank-unique keys)
#: is then a view per tensor, as before. A larger group gathers only the rows of the tensors
#: left open (:meth:`Group.gather`), once.
_STACK_MEMBERS = 64


@dataclass
class Group:
    """Ranks whose shards have the same keys and table width: their shard rows (rank-local file
    indices, one width); or one rank's own items. And, per member, the manifest's index of its
    first file."""

    tables: Sequence[np.ndarray]
    bases: np.ndarray  # int64, one per member
    # Rows gathered side by side (gathered rows x columns x members, file indices the manifest's)
    # and the row of ``_stack`` that holds each position (``None``: position p is row p).
    _stack: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _index: dict[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def width(self) -> int:
        """``D``: offset (and size) columns of the group's tables."""
        return (self.tables[0].shape[1] - 4) // 2

    def row(self, j: int, p: int) -> list[int]:
        """Member ``j``'s row ``p``, its file index the manifest's."""
        r = self.tables[j][p].tolist()
        r[FILE] += int(self.bases[j])
        return r

    def gather(self, positions: Sequence[int]) -> None:
        """Gather the rows at ``positions`` of every member at once, for :meth:`column`: one
        pass over the members for all the tensors the batched path left open, not one per
        tensor (O(members x open tensors) Python otherwise). Small groups stack every row."""
        if self._stack is not None or not len(positions):
            return
        if len(self.tables) <= _STACK_MEMBERS:
            self._stack = np.stack(self.tables, axis=2)
        else:
            rows = np.unique(np.asarray(positions, dtype=np.int64))
            self._stack = np.stack([t[rows] for t in self.tables], axis=2)
            self._index = {int(p): k for k, p in enumerate(rows)}
        self._stack[:, FILE, :] += self.bases

    def column(self, p: int) -> np.ndarray:
        """Row ``p`` of every member, as columns x members (file indices the manifest's); from
        the rows :meth:`gather` took when it holds ``p``."""
        if self._stack is None and len(self.tables) <= _STACK_MEMBERS:
            self.gather([p])
        if self._stack is not None and (self._index is None or p in self._index):
            return self._stack[p if self._index is None else self._index[p]]
        cols = np.stack([t[p] for t in self.tables], axis=1)
        cols[FILE] += self.bases
        return cols


@dataclass(frozen=True)
class Spec:
    """What a tensor's grid needs besides its rows: shape, element size, DCP's chunk count."""

    shape: tuple[int, ...]
    esize: int
    chunks: int


@dataclass
class _Tensor:
    """A tensor on the batched path: its parts (group, position), where each starts among its
    rows, and the grid its first row names (``split``: the one dimension cut in several cells)."""

    parts: list[tuple[int, int]]
    starts: list[int]
    n: int
    block: tuple[int, ...]
    split: int
    steps: list[int]  # per part: the file step of its regular pairs (0 for a part of one row)
    irregular: list[int]  # pair indices r (rows r, r + 1), tensor-wide


def batched_grids(
    groups: Sequence[Group],
    parts: Sequence[Sequence[tuple[int, int]]],
    specs: Sequence[Spec | None],
    names: Sequence[str],
) -> list[GridChunks | None]:
    """Per tensor, its grid, or ``None`` where this path does not decide (the caller then runs
    ``grid_from_rows`` on the tensor's rows). ``parts[t]``: where tensor ``t``'s rows are, in
    order (group, position in its members' tables); ``specs[t]``: ``None`` for an item that is
    not a tensor to store as a grid."""
    members = [len(g.tables) for g in groups]
    single: dict[int, GridChunks | None] = {}  # tensors of one cell written by one rank: decided at once
    found: list[_Tensor | None] = []
    for t, (ps, spec) in enumerate(zip(parts, specs)):
        if spec is not None and spec.chunks == 1 and len(ps) == 1 and members[ps[0][0]] == 1:
            single[t] = _one_cell(groups[ps[0][0]], ps[0][1], spec, names)
            found.append(None)
        else:
            found.append(_start(groups, members, ps, spec) if spec is not None else None)
    held: list[list[tuple[int, int, int]]] = [[] for _ in groups]  # per group: (tensor, part, position)
    for t, tensor in enumerate(found):
        if tensor is not None:
            for q, (g, p) in enumerate(tensor.parts):
                held[g].append((t, q, p))
    for group, here in zip(groups, held):
        if len(group.tables) > 1 and here:
            _scan(group, here, found)
    out: list[GridChunks | None] = []
    for t, spec in enumerate(specs):
        tensor = found[t]
        if t in single:
            out.append(single[t])
        else:
            out.append(None if tensor is None or spec is None else _finish(groups, tensor, spec, names))
    return out


def _one_cell(group: Group, p: int, spec: Spec, names: Sequence[str]) -> GridChunks | None:
    """The grid of a tensor that one rank wrote whole (a rank's generator state, a replicated
    value): one cell, the whole shape. The training state of 16,384 ranks has about 115,000
    such tensors (each rank's own), so this is the few checks :func:`_finish` would make of its
    one row, without the machinery for many; ``None`` where the row is not that cell."""
    shape, dims = spec.shape, len(spec.shape)
    if not dims or 0 in shape or group.width < dims:
        return None
    row = group.row(0, p)
    w = group.width
    if row[NDIM] != dims or any(row[4 : 4 + dims]) or tuple(row[4 + w : 4 + w + dims]) != shape:
        return None
    if row[LENGTH] != math.prod(shape) * spec.esize:
        return None
    return GridChunks(shape, shape, spec.esize, ((1, row[FILE], 1, row[OFFSET]),), names)


def _start(
    groups: Sequence[Group], members: Sequence[int], parts: Sequence[tuple[int, int]], spec: Spec
) -> _Tensor | None:
    """The grid the tensor's first row names, if the tensor can take this path (``members``:
    each group's member count)."""
    shape, dims = spec.shape, len(spec.shape)
    starts = [0, *accumulate(members[g] for g, _ in parts)]
    n = starts.pop()
    if (
        n != spec.chunks or len(parts) > 64 + n // 64
    ):  # one group per rank or so: the boundaries would all be looked at in Python
        return None
    if not parts or not dims or 0 in shape or any(groups[g].width < dims for g, _ in parts):
        return None
    g, p = parts[0]
    row = groups[g].row(0, p)
    w = groups[g].width
    block = tuple(row[4 + w : 4 + w + dims])
    if any(not 1 <= b <= s for b, s in zip(block, shape)):
        return None
    counts = [-(-s // b) for s, b in zip(shape, block)]
    cut = [d for d, c in enumerate(counts) if c > 1]
    if len(cut) > 1 or math.prod(counts) != n:
        return None
    return _Tensor(list(parts), starts, n, block, cut[0] if cut else 0, [0] * len(parts), [])


def _scan(group: Group, here: Sequence[tuple[int, int, int]], found: list[_Tensor | None]) -> None:
    """Find the irregular pairs of the group's tensors (``here``: tensor, part, position; the
    group has two members or more), appended to each one's ``irregular``, and each part's step;
    a tensor with too many irregular pairs, or a step that is not positive, drops out."""
    k = len(group.tables)
    items, cols = group.tables[0].shape
    owner = np.full(items, -1, dtype=np.int64)  # per position: the tensor there on this path
    part_of: dict[int, int] = {}
    for t, q, p in here:
        owner[p], part_of[p] = t, q
    step = (group.tables[1][:, FILE] + group.bases[1]) - (group.tables[0][:, FILE] + group.bases[0])
    expected = np.zeros((items, cols), dtype=np.int64)  # the difference of two consecutive members' rows
    expected[:, FILE] = step
    for p in np.flatnonzero(owner >= 0).tolist():
        tensor = found[owner[p]]
        if tensor is None:  # dropped at an earlier part (of this group or an earlier one)
            continue
        tensor.steps[part_of[p]] = int(step[p])
        if int(step[p]) <= 0:
            found[owner[p]] = None  # regular pairs would not link: grid_from_rows decides
            continue
        expected[p, 4 + tensor.split] = tensor.block[tensor.split] if tensor.n > 1 else 0
    active = np.array([owner[p] >= 0 and found[owner[p]] is not None for p in range(items)], dtype=bool)
    cap = np.array([_irregular_cap(found[o].n) if o >= 0 and found[o] is not None else 0 for o in owner.tolist()])  # type: ignore[union-attr]
    seen = np.zeros(items, dtype=np.int64)
    per = max(2, _BLOCK_ELEMENTS // max(1, items * cols))
    buf = np.empty((per, items, cols), dtype=np.int64)
    diff = np.empty((per - 1, items, cols), dtype=np.int64)
    differ = np.empty((per - 1, items, cols), dtype=bool)
    found_j: list[np.ndarray] = []
    found_p: list[np.ndarray] = []
    a = 0
    while a < k - 1:
        e = min(a + per - 1, k - 1)  # members a..e: pairs a..e-1
        m = e - a + 1
        block = np.stack(group.tables[a : e + 1], axis=0, out=buf[:m])
        block[:, :, FILE] += group.bases[a : e + 1, None]
        d = np.subtract(block[1:], block[:-1], out=diff[: m - 1])
        irregular = _any_last(np.not_equal(d, expected, out=differ[: m - 1]))
        irregular &= active
        where = np.flatnonzero(irregular.any(axis=0))  # positions with any: a few, usually
        if len(where):
            jj, pp = np.nonzero(irregular[:, where])
            pp = where[pp]
            found_j.append(jj + a)
            found_p.append(pp)
            seen += np.bincount(pp, minlength=items)
            over = active & (seen > cap)
            if over.any():
                active &= ~over
        a = e
    for p in np.flatnonzero(~active & (owner >= 0)).tolist():
        found[owner[p]] = None
    if not found_p:
        return
    jj, pp = np.concatenate(found_j), np.concatenate(found_p)
    order = np.argsort(pp, kind="stable")  # by position; members ascending within one
    jj, pp = jj[order], pp[order]
    bounds = np.searchsorted(pp, np.arange(items + 1))
    for p in np.flatnonzero(active).tolist():
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        tensor = found[owner[p]]
        if lo < hi and tensor is not None:
            start = tensor.starts[part_of[p]]
            tensor.irregular.extend((jj[lo:hi] + start).tolist())


def _any_last(flags: np.ndarray) -> np.ndarray:
    """``flags.any(axis=-1)`` for a C-contiguous boolean array: its rows read as words of up to
    8 bytes (a row is 4 + 2 D bytes, an even number: 3 words for D = 1, 5 for D = 3). numpy reduces a short last axis one
    element at a time, 0.28 s of the scan at 17 M rows; this is a comparison per word."""
    size = flags.shape[-1]
    word = next(w for w in (8, 4, 2, 1) if size % w == 0)
    words = flags.view(f"<u{word}")
    out = words[..., 0] != 0
    for c in range(1, words.shape[-1]):
        out |= words[..., c] != 0
    return out


def _finish(groups: Sequence[Group], tensor: _Tensor, spec: Spec, names: Sequence[str]) -> GridChunks | None:
    """Check the anchors in full and form the runs; ``None`` when an anchor is not its cell."""
    n, dims, starts = tensor.n, len(spec.shape), tensor.starts
    irregular = sorted(
        set(tensor.irregular) | {s - 1 for s in starts[1:]}
    )  # a part's first row follows a pair of two groups
    if len(irregular) > _irregular_cap(n) + len(starts):
        return None

    def row(r: int) -> tuple[int, int, int, tuple[int, ...]]:
        """Row ``r``'s file, byte offset, length and sizes; the sizes empty when the row is
        not cell ``r`` of the grid (a row that is may not come out empty: a grid has dimensions)."""
        q = bisect.bisect_right(starts, r) - 1
        g, p = tensor.parts[q]
        v = groups[g].row(r - starts[q], p)
        w = groups[g].width
        sizes = tuple(v[4 + w : 4 + w + dims])
        return (
            v[FILE],
            v[OFFSET],
            v[LENGTH],
            sizes if v[NDIM] == dims and _is_cell(v[4 : 4 + dims], sizes, v[LENGTH], r, tensor, spec) else (),
        )

    anchors = {0, n - 1} | {r + 1 for r in irregular}
    rows = {r: row(r) for r in anchors | set(irregular)}
    if any(not rows[r][3] for r in anchors):
        return None
    links: dict[int, tuple[bool, int]] = {}
    for r in irregular:
        (f0, o0, _, s0), (f1, o1, _, s1) = rows[r], rows[r + 1]
        if not s0:  # a row that is not its cell, yet between two that are: left to grid_from_rows
            return None
        links[r] = (o0 == o1 and f1 - f0 > 0 and s0 == s1, f1 - f0)

    def link(r: int) -> tuple[bool, int]:
        got = links.get(r)
        return got if got is not None else (True, tensor.steps[bisect.bisect_right(starts, r) - 1])

    def cell(k: int) -> tuple[int, int]:
        file, offset, *_ = rows[k] if k in rows else row(k)
        return file, offset

    breaks = sorted(
        b
        for b in {x for r in irregular for x in (r, r + 1)}
        if 1 <= b <= n - 2 and (not link(b)[0] or link(b)[1] != link(b - 1)[1])
    )
    return GridChunks(spec.shape, tensor.block, spec.esize, greedy_runs(n, breaks, cell, link), names)


def _is_cell(offsets: Sequence[int], sizes: Sequence[int], length: int, i: int, tensor: _Tensor, spec: Spec) -> bool:
    """Whether a row is cell ``i`` of the tensor's grid: its offsets, its sizes (torch's chunk
    rule: the block, less on the last cell) and its byte length."""
    for d, (o, sz, b, s) in enumerate(zip(offsets, sizes, tensor.block, spec.shape)):
        want = i * b if d == tensor.split else 0
        if o != want or sz != min(b, s - want):
            return False
    return length == math.prod(sizes) * spec.esize
