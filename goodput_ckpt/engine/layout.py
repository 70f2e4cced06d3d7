"""Byte layout of a rank's data files, and their division into hash chunks.

The writer first decides, from sizes alone, where every item goes: which file, at which
(``ALIGNMENT``-aligned) offset. Each file is then cut into fixed-size chunks; a chunk is the
unit of hashing, of a write call (and of an S3 part), and of parallelism. Writing chunk by chunk
lets a worker hash exactly the bytes it hands to the store, with no re-read and no extra copy.

Shards of one tensor lie at one offset in every rank's file where the writer can make them
(:func:`rank_placements`): a rank gives each shard of a row-sharded tensor a *slot* of the size
torch's chunk rule gives a full block (``ceil(rows / world)`` rows), also when its own shard is
shorter (:func:`shard_slot`); it lays its shards out in an order every rank computes alike (those
of tensors every rank holds first, then those held by fewer ranks, by how many: a rank past a
tensor's end holds no item for it, the save planner drops empty shards), and its replicated values
after its shards, in one hash chunk where they fit in one. Then the commit record describes such a
tensor as one or two grid runs whatever the number of ranks, instead of about one run per rank
(each rank's uneven or missing shards shifted every later item of its file): on a real FSDP2 +
AdamW layout of small tensors the record's runs grew 2.5x from 2 to 8 ranks, and ``read_metadata``
with them (issue 37, "Restore on a real layout"; docs/scale.md). The padding is bounded: no rank's
shards take more bytes than those of a rank holding a full block of every tensor (rank 0's), and
the slots add less than one block per tensor in all (the short last shard's rest; a planner that
keeps empty shards, not ours, adds a block for each).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.manifest import ALIGNMENT

__all__ = [
    "ChunkPlan",
    "Placement",
    "Segment",
    "ShardShape",
    "chunk_plans",
    "place_items",
    "rank_placements",
    "shard_slot",
]


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


def _align(n: int, to: int = ALIGNMENT) -> int:
    return (n + to - 1) // to * to


#: Items whose slot is at least this large start at a multiple of :data:`PAGE` in their file (the
#: format asks for ``ALIGNMENT`` only): then a page-aligned buffer (a manager's staging buffer)
#: is a page-aligned run of the file, and a save that writes around the page cache writes its
#: chunks where they lie instead of copying them into a bounce buffer first
#: (``goodput_ckpt.storage.direct_write``). The padding is under a page per such item.
PAGE_ITEM_MIN = 1 << 20
PAGE = 4096


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True)
class ShardShape:
    """What a rank knows of one shard it writes: the tensor's global shape, the shard's box in it
    (offsets and sizes per dimension) and the element size in bytes."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    esize: int


def shard_slot(shard: ShardShape, world: int) -> int:
    """Bytes a rank reserves for ``shard`` in its file: those of a full block of torch's chunk
    rule along dimension 0 (``ceil(shape[0] / world)`` rows, all of every other dimension) when
    the shard is such a block, the short last one or an empty one; its own bytes otherwise (any
    other sharding: nothing changes for it).

    Every rank computes the same slot for a tensor from what every rank knows (the global shape
    and the number of ranks), so that a tensor's shard lies at one offset in every rank's file
    (see the module doc).
    """
    cut = _fsdp_cut(shard, world)
    own = _prod(shard.sizes) * shard.esize
    return own if cut is None else max(own, cut[0] * _prod(shard.shape[1:]) * shard.esize)


def _fsdp_cut(shard: ShardShape, world: int) -> tuple[int, int] | None:
    """``(rows per block, blocks holding rows)`` when ``shard`` is one block of torch's chunk
    rule over ``world`` ranks along dimension 0 (or an empty shard of such a tensor), else
    ``None``."""
    shape, offsets, sizes = shard.shape, shard.offsets, shard.sizes
    if world < 2 or not shape or not shape[0] or len(offsets) != len(shape) or len(sizes) != len(shape):
        return None
    if tuple(sizes[1:]) != tuple(shape[1:]) or any(offsets[1:]):
        return None
    rows = -(-shape[0] // world)
    if sizes[0] and (offsets[0] % rows or sizes[0] != min(rows, shape[0] - offsets[0])):
        return None
    return rows, -(-shape[0] // rows)


def rank_placements(
    sizes: list[int], shards: list[ShardShape | None], file_count: int, world: int, chunk_size: int | None = None
) -> tuple[list[Placement], list[int]]:
    """A rank's layout (the writer's; see the module doc). ``shards[i]``: item ``i``'s shard,
    ``None`` for an item that is not one (a replicated value some rank keeps).

    Order in the files: the shards cut by torch's chunk rule, those of tensors with more blocks
    first (every rank holds a block of a tensor with ``world`` of them; a tensor of ``b`` blocks
    is held by ranks ``0 .. b - 1`` only, so each rank's shards are a prefix of one order that
    every rank shares), in their given order among equals; then other shards; then the items
    that are not shards, together, and within one hash chunk of ``chunk_size`` bytes where they
    fit in one (every rank reads the replicated values at a restore: one chunk to read and
    verify, not two). Returns what :func:`place_items` returns, indexed like ``sizes``.
    """
    cuts = [None if s is None else _fsdp_cut(s, world) for s in shards]

    def rank_of(i: int) -> tuple[int, int]:
        if shards[i] is None:
            return (2, 0)
        cut = cuts[i]
        return (1, 0) if cut is None else (0, -cut[1])

    order = sorted(range(len(sizes)), key=rank_of)  # stable: the given order among equals
    head = sum(1 for s in shards if s is not None)
    slots = [sizes[i] if shards[i] is None else max(sizes[i], shard_slot(shards[i], world)) for i in order]
    placed, file_sizes = place_items([sizes[i] for i in order], file_count, slots=slots, head=head)
    if chunk_size and chunk_size % ALIGNMENT == 0:
        placed, file_sizes = _tail_in_one_chunk(placed, file_sizes, head, chunk_size)
    out: list[Placement] = [None] * len(sizes)  # type: ignore[list-item]
    for p in placed:
        out[order[p.item]] = Placement(order[p.item], p.file, p.offset, p.length)
    return out, file_sizes


def _tail_in_one_chunk(
    placed: list[Placement], file_sizes: list[int], head: int, chunk_size: int
) -> tuple[list[Placement], list[int]]:
    """The items after the first ``head`` (the last of each file) moved to the next chunk
    boundary of their file where they would cross one and fit in one chunk: the padding is less
    than their own bytes."""
    sizes = list(file_sizes)
    for f in range(len(sizes)):
        tail = [p for p in placed if p.item >= head and p.file == f]
        if not tail:
            continue
        start, end = tail[0].offset, sizes[f]
        if start // chunk_size == max(start, end - 1) // chunk_size or end - start > chunk_size:
            continue
        shift = (start // chunk_size + 1) * chunk_size - start  # aligned: chunk_size is
        moved = {p.item for p in tail}
        placed = [Placement(p.item, p.file, p.offset + shift, p.length) if p.item in moved else p for p in placed]
        sizes[f] += shift
    return placed, sizes


def place_items(
    sizes: list[int], file_count: int, *, slots: list[int] | None = None, head: int | None = None
) -> tuple[list[Placement], list[int]]:
    """Assign items to ``file_count`` files, balancing bytes, keeping item order within a file.

    ``slots`` (each at least its item's size): the bytes each item takes in its file before the
    next one starts (the rest is zero padding); default its size. ``head``: the first ``head``
    items are spread over the files before the others are (so that the others cannot move them
    between files); default all.

    Returns the placements (indexed like ``sizes``) and the size of each file (up to its last
    item's end, without a trailing slot's padding). Files that
    would receive no bytes are dropped (``file_count`` is an upper bound): an empty file is a
    hazard on an object-store mount (``rclone mount`` without a cache uploads a file that got
    no write only after ``close`` has returned), and a request for nothing everywhere else.
    Only a rank whose items are all empty gets one empty file.
    """
    file_count = max(1, min(file_count, sum(1 for n in sizes if n))) if sizes else 0
    slots = sizes if slots is None else slots
    head = len(sizes) if head is None else head
    loads = [0] * file_count
    owner = [0] * len(sizes)
    if file_count > 1:
        # Largest first onto the least-loaded file: near-even files without splitting items.
        for part in (range(head), range(head, len(sizes))):
            for i in sorted(part, key=lambda i: -slots[i]):
                f = min(range(file_count), key=loads.__getitem__)
                owner[i] = f
                loads[f] += _align(slots[i])
    placements: list[Placement | None] = [None] * len(sizes)
    ends = [0] * file_count
    used = [0] * file_count
    for i, size in enumerate(sizes):
        f = owner[i]
        off = _align(ends[f], PAGE if slots[i] >= PAGE_ITEM_MIN else ALIGNMENT)  # slots: equal on every rank
        placements[i] = Placement(i, f, off, size)
        ends[f] = off + slots[i]
        used[f] = off + size  # (an empty item's offset too lies within its file)
    return [p for p in placements if p is not None], used


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
