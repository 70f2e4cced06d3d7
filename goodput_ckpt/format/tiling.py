"""Whether the chunks of a tensor tile its shape: every element stored exactly once.

Otherwise a load would leave part of the destination unwritten, or take an element from
whichever chunk it reads last. The saved boxes lie inside the shape (the parser checks that
first), so they tile it exactly when their volumes add up to the tensor's and no two of them
overlap. Deciding the second part must not cost time quadratic in the chunk count, or a small
manifest could stall every reader (a "staircase": each column of an n x n tensor split at a
different row, n = 4,000, used to take 30 s):

- dimensions that every box spans whole are dropped (they cannot separate two boxes);
- one dimension left: sort and compare neighbours, O(n log n);
- two left: a sweep along the first, keeping the boxes it crosses as disjoint intervals of the
  second in a Fenwick tree over their start coordinates, so each box costs a few O(log n)
  neighbour queries: O(n log n) in all;
- three or more (rare: real shardings split one or two dimensions): a sweep that compares
  boxes pairwise where they overlap along the sweep dimension, within a budget of comparisons
  per manifest (:data:`MAX_PAIR_CHECKS`); a layout that needs more is refused with an error
  naming the limit (docs/format.md, "Limits that bound work").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["MAX_PAIR_CHECKS", "TilingBudget", "TilingError", "check_tiling"]

#: Box comparisons the pairwise sweep (three or more split dimensions) may make per manifest.
#: Grid shardings need a few per box; about 4 M comparisons take a few seconds in Python.
MAX_PAIR_CHECKS = 1 << 22

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


class TilingError(Exception):
    """The boxes do not tile the shape, or proving that they do would cost too much."""


class TilingBudget:
    """The comparisons left to the pairwise sweep for one manifest, and the work done overall
    (steps of the sweeps; tests read it to check the cost grows as n log n)."""

    __slots__ = ("pairs_left", "work")

    def __init__(self, pairs: int = MAX_PAIR_CHECKS) -> None:
        self.pairs_left = pairs
        self.work = 0


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], budget: TilingBudget | None = None) -> None:
    """Raise :class:`TilingError` unless ``boxes`` (each inside ``shape``) tile ``shape``.

    Raises:
        TilingError: elements are missing or stored twice (names two overlapping boxes), or the
            layout needs more comparisons than ``budget`` has left.
    """
    budget = budget if budget is not None else TilingBudget()
    full = [b for b in boxes if math.prod(b[1])]
    covered, numel = sum(math.prod(s) for _, s in full), math.prod(shape)
    if covered != numel:
        raise TilingError(f"its chunks hold {covered} of its {numel} elements; they must tile the shape")
    if len(full) < 2:
        return
    live = [d for d in range(len(shape)) if any(o[d] != 0 or s[d] != shape[d] for o, s in full)]
    if not live:  # two whole-tensor boxes (only possible for a shape with no elements)
        _overlap(full[0], full[1])
    elif len(live) == 1:
        _check_1d(full, live[0], budget)
    elif len(live) == 2:
        _check_2d(full, live[0], live[1], budget)
    else:
        _check_pairwise(shape, full, budget)


def _overlap(a: Box, b: Box) -> None:
    raise TilingError(f"chunks at offsets {list(a[0])} and {list(b[0])} overlap")


def _check_1d(boxes: list[Box], d: int, budget: TilingBudget) -> None:
    order = sorted(boxes, key=lambda b: b[0][d])
    budget.work += len(order)
    for a, b in zip(order, order[1:]):
        if b[0][d] < a[0][d] + a[1][d]:
            _overlap(a, b)


def _check_2d(boxes: list[Box], x: int, y: int, budget: TilingBudget) -> None:
    """Sweep along ``x``; the boxes the sweep line crosses must be disjoint along ``y``."""
    starts = sorted({b[0][y] for b in boxes})
    rank = {s: i for i, s in enumerate(starts)}
    tree = _Fenwick(len(starts))
    active: list[int] = [-1] * len(starts)  # start rank -> the box starting there, or -1
    # Each event is one integer, (x * 2 + entering) * n + box (a third of a tuple's memory):
    # leaving sorts before entering at the same x, as a box ending where another starts does
    # not overlap it.
    n_boxes = len(boxes)
    events = [((b[0][x] + b[1][x]) * 2) * n_boxes + i for i, b in enumerate(boxes)]
    events += [(b[0][x] * 2 + 1) * n_boxes + i for i, b in enumerate(boxes)]
    events.sort()
    for event in events:
        rest, i = divmod(event, n_boxes)
        entering = rest & 1
        lo, n = boxes[i][0][y], boxes[i][1][y]
        r = rank[lo]
        if not entering:
            tree.add(r, -1)
            active[r] = -1
            continue
        if active[r] >= 0:
            _overlap(boxes[active[r]], boxes[i])
        before = tree.prefix(r)  # active boxes starting below lo
        if before:
            j = active[tree.kth(before)]  # the nearest one below: it must end by lo
            if boxes[j][0][y] + boxes[j][1][y] > lo:
                _overlap(boxes[j], boxes[i])
        if before < tree.total:
            j = active[tree.kth(before + 1)]  # the nearest one above: it must start at lo + n or later
            if boxes[j][0][y] < lo + n:
                _overlap(boxes[i], boxes[j])
        tree.add(r, 1)
        active[r] = i
    budget.work += tree.steps


class _Fenwick:
    """Counts of active interval starts by rank, with prefix sums and k-th lookups in O(log n)."""

    __slots__ = ("n", "tree", "total", "steps", "top")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.total = 0
        self.steps = 0  # loop iterations, the measure of work
        self.top = 1 << n.bit_length()

    def add(self, i: int, delta: int) -> None:
        self.total += delta
        i += 1
        while i <= self.n:
            self.tree[i] += delta
            i += i & -i
            self.steps += 1

    def prefix(self, i: int) -> int:
        """Active starts with rank below ``i``."""
        s = 0
        while i > 0:
            s += self.tree[i]
            i -= i & -i
            self.steps += 1
        return s

    def kth(self, k: int) -> int:
        """The rank of the ``k``-th active start (1-based)."""
        pos, step = 0, self.top
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] < k:
                pos = nxt
                k -= self.tree[nxt]
            step >>= 1
            self.steps += 1
        return pos


def _check_pairwise(shape: Sequence[int], boxes: list[Box], budget: TilingBudget) -> None:
    """Sweep along the dimension with the most distinct offsets, comparing boxes that overlap
    along it; grid shardings cost about n log n, adversarial layouts run into the budget."""
    d = max(range(len(shape)), key=lambda i: len({o[i] for o, _ in boxes}))
    order = sorted(boxes, key=lambda b: b[0][d])
    for i, (o0, s0) in enumerate(order):
        for o1, s1 in order[i + 1 :]:
            if o1[d] >= o0[d] + s0[d]:
                break
            budget.pairs_left -= 1
            budget.work += 1
            if budget.pairs_left < 0:
                raise TilingError(
                    f"its {len(boxes)} chunks form a layout that needs more than {MAX_PAIR_CHECKS} "
                    "comparisons to prove they do not overlap (the limit per manifest, for tensors "
                    "split along three or more dimensions; see docs/format.md)"
                )
            if all(a < c + t and c < a + s for a, s, c, t in zip(o0, s0, o1, s1)):
                _overlap((o0, s0), (o1, s1))
