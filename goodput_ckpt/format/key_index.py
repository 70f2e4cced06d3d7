"""Which state-dict keys own a byte range of a data file, for problem reports (issue 33).

Why a module of its own: every report of a missing, resized or damaged file names the keys
stored there (``verify``, ``inspect``, the reader, the tiers, ``reshard``'s source), and a
format-v2 grid must not be expanded into its cells to answer that. A 186 KB manifest can
describe 4 M cells (a grid of one-byte blocks over 1,024 files); expanding them cost ``verify
--quick`` 13 s of CPU and 483 MB here (61 s and 546 MB in the issue) when the files were
missing; now 0.1 s and 1.4 MB (``benchmarks/probe_grid_consumers.py``). Here a grid is looked at run by
run: a run's cells share one byte range, in files that form an arithmetic progression, so
"which runs touch file ``f`` in ``[lo, hi)``" is a few vectorized comparisons over the runs
whose byte range can reach ``[lo, hi)``. Explicit chunks (v1) and objects are listed per file,
as the manifest lists them. No torch here.

Cost: building is O(runs + explicit entries). A query scans the runs in its byte window at
C speed (one element per run, never one per cell) and spends Python time only on the keys it
returns. The scans of one index are capped at :data:`MAX_KEY_INDEX_WORK` run-elements in all,
set from a real record: the 70B model with its training state at 16,384 ranks
(``benchmarks/bench_scale.py``'s simulation, ``docs/scale.md``: 6,527 runs, 17.4 M cells)
scans 70 M run-elements when every one of its 16,384 files is missing (5.1 s of CPU here, most
of it naming the 17.4 M (file, key) pairs the report holds). Past the cap, a query names the
keys of explicit entries only and counts itself in :attr:`KeyIndex.unresolved`: the problems
are all still reported, some without their grid keys.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from .grid import GridChunks
from .schema import Manifest, ObjectEntry, TensorEntry

__all__ = ["MAX_KEY_INDEX_WORK", "KeyIndex"]

#: Run-elements the queries of one :class:`KeyIndex` may scan in all (see the module docstring):
#: 2**28, 3.8x what the 70B record at 16,384 ranks needs with every file missing.
MAX_KEY_INDEX_WORK = 1 << 28


class _Runs:
    """The runs of the grids over one file list, as arrays sorted by byte offset."""

    def __init__(self, names: Sequence[str], runs: list[tuple[int, int, int, int, int, int]]) -> None:
        self.index = {n: i for i, n in enumerate(names)}
        a = np.array(sorted(runs), dtype=np.int64).reshape(-1, 6)  # offset, end, first, last, step, key id
        self.off, self.end, self.first, self.last, self.step, self.key = (a[:, i].copy() for i in range(6))
        self.longest = int((self.end - self.off).max()) if len(a) else 0


class KeyIndex:
    """Which state-dict keys own the bytes ``[lo, hi)`` of a data file (for problem reports).

    Built on the first query (most reads never report a problem); safe to share between threads
    (two threads that build at once build the same index). ``work`` counts the run-elements the
    queries scanned (the budget's measure), ``unresolved`` the queries past the budget.
    """

    def __init__(self, manifest: Manifest, budget: int = MAX_KEY_INDEX_WORK) -> None:
        self._manifest = manifest
        self._built = False
        self.work = 0
        self.budget = budget
        self.unresolved = 0

    def _build(self) -> None:
        per_file: dict[str, list[tuple[int, int, str]]] = {}
        keys: list[str] = []
        grids: dict[int, tuple[Sequence[str], list[tuple[int, int, int, int, int, int]]]] = {}
        for key, e in self._manifest.items.items():
            if isinstance(e, TensorEntry) and isinstance(e.chunks, GridChunks):
                g = e.chunks
                _, runs = grids.setdefault(id(g.names), (g.names, []))
                kid, n = len(keys), 0
                keys.append(key)
                for count, first, step, offset in g.runs:
                    _, sizes = g.box(n)
                    length = max(math.prod(sizes) * g.esize, 1)
                    runs.append((offset, offset + length, first, first + step * (count - 1), step, kid))
                    n += count
            elif isinstance(e, TensorEntry):
                for c in e.chunks:
                    per_file.setdefault(c.file, []).append((c.offset, c.offset + max(c.length, 1), key))
            elif isinstance(e, ObjectEntry):
                per_file.setdefault(e.file, []).append((e.offset, e.offset + max(e.length, 1), key))
        self._grid_keys = keys
        self._grids = [_Runs(names, runs) for names, runs in grids.values()]
        self._ranges = {f: sorted(r) for f, r in per_file.items()}
        self._starts = {f: [r[0] for r in rs] for f, rs in self._ranges.items()}
        # Items never overlap (the manifest is validated), so the longest item bounds how far
        # back an overlapping one can start.
        self._longest = {f: max((e - s for s, e, _ in rs), default=0) for f, rs in self._ranges.items()}
        self._built = True

    def keys(self, file: str, lo: int, hi: int) -> list[str]:
        """Keys (in file order, without repeats) whose bytes overlap ``[lo, hi)`` of ``file``."""
        if not self._built:
            self._build()
        found: list[tuple[int, str]] = []
        ranges = self._ranges.get(file, [])
        i = bisect.bisect_left(self._starts.get(file, []), lo - self._longest.get(file, 0))
        while i < len(ranges) and ranges[i][0] < hi:
            s, e, key = ranges[i]
            if lo < e:
                found.append((s, key))
            i += 1
        for runs in self._grids:
            found.extend(self._grid_keys_in(runs, file, lo, hi))
        found.sort(key=lambda p: p[0])
        out: list[str] = []
        seen: set[str] = set()
        for _, key in found:
            if key not in seen:
                seen.add(key)
                out.append(key)
        return out

    def _grid_keys_in(self, runs: _Runs, file: str, lo: int, hi: int) -> list[tuple[int, str]]:
        """(first byte, key) of each grid key with a run touching ``[lo, hi)`` of ``file``."""
        f = runs.index.get(file)
        if f is None:
            return []
        a = int(np.searchsorted(runs.off, lo - runs.longest, side="right"))
        b = int(np.searchsorted(runs.off, hi, side="left"))
        if b <= a:
            return []
        if self.work + (b - a) > self.budget:
            self.unresolved += 1
            return []
        self.work += b - a
        first, step = runs.first[a:b], runs.step[a:b]
        hit = (first <= f) & (runs.last[a:b] >= f) & (runs.end[a:b] > lo) & ((f - first) % step == 0)
        kids, at = np.unique(runs.key[a:b][hit], return_index=True)
        offs = runs.off[a:b][hit][at]
        return [(int(o), self._grid_keys[int(k)]) for o, k in zip(offs, kids)]

    def joined(self, file: str, lo: int, hi: int) -> str:
        """:meth:`keys` as one comma-separated string (an error's ``key``)."""
        return ", ".join(self.keys(file, lo, hi))
