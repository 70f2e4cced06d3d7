"""Byte layout of a rank's data files, and their division into hash chunks.

The writer first decides, from sizes alone, where every item goes: which file, at which
(``ALIGNMENT``-aligned) offset. Each file is then cut into fixed-size chunks; a chunk is the
unit of hashing, of a write call (and of an S3 part), and of parallelism. Writing chunk by chunk
lets a worker hash exactly the bytes it hands to the store, with no re-read and no extra copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.manifest import ALIGNMENT

__all__ = ["ChunkPlan", "Placement", "Segment", "chunk_plans", "place_items"]


@dataclass(frozen=True)
class Placement:
    """Where one item (by its index in the rank's item list) lies."""

    item: int
    file: int
    offset: int
    length: int


@dataclass(frozen=True)
class Segment:
    """A piece of a chunk: bytes ``[start, end)`` of ``item``, or zero padding when item is -1."""

    item: int
    start: int
    end: int


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of one file: its file offset and the pieces that fill it, in order."""

    file: int
    index: int
    offset: int
    length: int
    segments: tuple[Segment, ...]


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def place_items(sizes: list[int], file_count: int) -> tuple[list[Placement], list[int]]:
    """Assign items to ``file_count`` files, balancing bytes, keeping item order within a file.

    Returns the placements (indexed like ``sizes``) and the size of each file. Files that
    would receive no bytes are dropped (``file_count`` is an upper bound): an empty file is a
    hazard on an object-store mount (``rclone mount`` without a cache uploads a file that got
    no write only after ``close`` has returned), and a request for nothing everywhere else.
    Only a rank whose items are all empty gets one empty file.
    """
    file_count = max(1, min(file_count, sum(1 for n in sizes if n))) if sizes else 0
    loads = [0] * file_count
    owner = [0] * len(sizes)
    if file_count > 1:
        # Largest first onto the least-loaded file: near-even files without splitting items.
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            f = min(range(file_count), key=loads.__getitem__)
            owner[i] = f
            loads[f] += _align(sizes[i])
    placements: list[Placement | None] = [None] * len(sizes)
    ends = [0] * file_count
    for i, size in enumerate(sizes):
        f = owner[i]
        off = _align(ends[f])
        placements[i] = Placement(i, f, off, size)
        ends[f] = off + size
    return [p for p in placements if p is not None], ends


def chunk_plans(placements: list[Placement], file_sizes: list[int], chunk_size: int) -> list[list[ChunkPlan]]:
    """Cut each file into chunks of ``chunk_size`` bytes (the last may be shorter)."""
    by_file: list[list[Placement]] = [[] for _ in file_sizes]
    for p in placements:
        by_file[p.file].append(p)
    out: list[list[ChunkPlan]] = []
    for f, size in enumerate(file_sizes):
        items = sorted(by_file[f], key=lambda p: p.offset)
        chunks: list[ChunkPlan] = []
        j = 0
        for index, start in enumerate(range(0, size, chunk_size)):
            end = min(start + chunk_size, size)
            segs: list[Segment] = []
            pos = start
            while j < len(items) and items[j].offset + items[j].length <= start:
                j += 1
            k = j
            while pos < end:
                if k < len(items) and items[k].offset <= pos < items[k].offset + items[k].length:
                    p = items[k]
                    stop = min(end, p.offset + p.length)
                    segs.append(Segment(p.item, pos - p.offset, stop - p.offset))
                    pos = stop
                    k += 1
                else:
                    nxt = items[k].offset if k < len(items) else end
                    if k < len(items) and items[k].length == 0 and items[k].offset <= pos:
                        k += 1  # empty items occupy no bytes
                        continue
                    stop = min(end, nxt) if nxt > pos else end
                    segs.append(Segment(-1, 0, stop - pos))
                    pos = stop
            chunks.append(ChunkPlan(f, index, start, end - start, tuple(segs)))
        out.append(chunks)
    return out
