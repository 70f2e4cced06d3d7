"""Byte layout and chunking of data files."""

from __future__ import annotations

import random

import pytest

from goodput_ckpt.engine.layout import (
    PAGE,
    PAGE_ITEM_MIN,
    ShardShape,
    chunk_plans,
    place_items,
    rank_placements,
    shard_slot,
)
from goodput_ckpt.format.manifest import ALIGNMENT


@pytest.mark.parametrize("file_count", [1, 2, 5])
@pytest.mark.parametrize("chunk_size", [64, 100, 4096])
def test_chunks_cover_every_byte_exactly_once(file_count, chunk_size):
    rng = random.Random(file_count * 1000 + chunk_size)
    sizes = [rng.choice([0, 1, 7, 63, 64, 65, 500, 3000]) for _ in range(40)]
    placements, file_sizes = place_items(sizes, file_count)
    assert len(placements) == len(sizes)
    for p in placements:
        assert p.offset % ALIGNMENT == 0 and p.length == sizes[p.item]
    # No two items of a file overlap.
    for f in range(len(file_sizes)):
        spans = sorted((p.offset, p.offset + p.length) for p in placements if p.file == f)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert file_sizes[f] == max((e for _, e in spans), default=0)
    plans = chunk_plans(placements, file_sizes, chunk_size)
    # Reassemble each file from its chunks and compare with a direct rendering.
    for f, chunks in enumerate(plans):
        want = bytearray(file_sizes[f])
        for p in placements:
            if p.file == f:
                want[p.offset : p.offset + p.length] = bytes([p.item % 251 + 1]) * p.length
        got = bytearray()
        for i, ch in enumerate(chunks):
            assert ch.index == i and ch.offset == i * chunk_size
            assert sum(s.end - s.start for s in ch.segments) == ch.length
            for s in ch.segments:
                got += bytes(s.end - s.start) if s.item < 0 else bytes([s.item % 251 + 1]) * (s.end - s.start)
        assert got == want


def test_balanced_files():
    placements, sizes = place_items([100] * 8 + [1000], 3)
    assert len(sizes) == 3
    assert max(sizes) <= 1000 + 64
    placements, sizes = place_items([], 4)
    assert placements == [] and sizes == []
    _, sizes = place_items([5, 5], 4)
    assert len(sizes) == 2


def test_no_file_holds_only_empty_items():
    """Empty tensors (an uneven shard) must not make empty files: see place_items."""
    placements, sizes = place_items([4096, 0, 0, 100, 0], 8)
    assert len(sizes) == 2 and all(sizes), sizes
    assert sorted(p.item for p in placements) == [0, 1, 2, 3, 4]
    _, sizes = place_items([0, 0, 0], 4)
    assert sizes == [0], "a rank with nothing to write still gets one (empty) file"


# -- shards at one offset in every rank's file (issue 37, "Restore on a real layout") -------------
def _fsdp_shard(shape: tuple[int, ...], rank: int, world: int, esize: int = 4) -> ShardShape:
    """Rank ``rank``'s shard of a tensor cut along dim 0 by torch's chunk rule (``ceil(n / world)``
    rows; ranks past the end hold an empty shard)."""
    block = -(-shape[0] // world)
    start = min(rank * block, shape[0])
    rows = min(block, shape[0] - start)
    return ShardShape(shape, (start,) + (0,) * (len(shape) - 1), (rows, *shape[1:]), esize)


def _nbytes(s: ShardShape) -> int:
    n = s.esize
    for d in s.sizes:
        n *= d
    return n


def test_a_shard_slot_is_the_full_block():
    world = 4
    full, short, empty = (_fsdp_shard((10, 16), r, world) for r in (0, 3, 3))
    assert shard_slot(full, world) == 3 * 16 * 4 == _nbytes(full)
    assert _nbytes(short) == 1 * 16 * 4 and shard_slot(short, world) == 3 * 16 * 4  # the short last shard
    tiny = _fsdp_shard((3,), 3, world)  # a rank past the tensor's end
    assert _nbytes(tiny) == 0 and shard_slot(tiny, world) == 4
    assert shard_slot(empty, 1) == _nbytes(empty), "one rank: nothing to line up"


def test_other_shardings_keep_their_own_size():
    world = 4
    # Cut along dim 1 (tensor parallel), a box that is not torch's block, a scalar.
    assert shard_slot(ShardShape((8, 16), (0, 4), (8, 4), 4), world) == 8 * 4 * 4
    assert shard_slot(ShardShape((10, 16), (1, 0), (2, 16), 4), world) == 2 * 16 * 4
    assert shard_slot(ShardShape((10, 16), (0, 0), (2, 16), 4), world) == 2 * 16 * 4  # HSDP: 5 rows a block
    assert shard_slot(ShardShape((), (), (), 4), world) == 4


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("file_count", [1, 3])
@pytest.mark.parametrize("empty_shards", ["dropped", "kept"])
def test_every_rank_holds_a_tensors_shard_at_one_offset(world, file_count, empty_shards):
    """Uneven shards, ranks past a tensor's end (without an item for it, as the save planner
    leaves them, or with an empty one) and rank 0's replicated values move no shard of any rank."""
    shapes = [(rows, 16) if k % 2 else (rows,) for k, rows in enumerate([3, 5, 7, 9, 13, 17, 33, 50] * 3)]
    where: dict[int, set] = {t: set() for t in range(len(shapes))}
    for rank in range(world):
        held = [(t, _fsdp_shard(s, rank, world)) for t, s in enumerate(shapes)]
        if empty_shards == "dropped":
            held = [(t, s) for t, s in held if _nbytes(s)]
        own = [1000, 31469, 4] if rank == 0 else []  # the lowest rank keeps the replicated values
        sizes = own + [_nbytes(s) for _, s in held]
        placements, file_sizes = rank_placements(sizes, [None] * len(own) + [s for _, s in held], file_count, world)
        assert [p.item for p in placements] == list(range(len(sizes)))
        assert [p.length for p in placements] == sizes
        for f in range(len(file_sizes)):
            spans = sorted((p.offset, p.offset + p.length) for p in placements if p.file == f)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            assert file_sizes[f] == spans[-1][1]
        shard_places = placements[len(own) :]
        for q in placements[: len(own)]:  # the replicated values after the shards of their file
            assert all(p.offset < q.offset for p in shard_places if p.file == q.file)
        for (t, s), p in zip(held, shard_places):
            if _nbytes(s):
                where[t].add((p.file, p.offset))
    assert all(len(w) == 1 for w in where.values()), "a tensor's shards lie at one place in every rank's files"


def test_slots_add_at_most_a_full_ranks_bytes():
    """No rank's shards take more bytes than rank 0's (a full block of every tensor)."""
    world = 8
    shapes = [(rows, 64) for rows in (3, 5, 7, 9, 13, 17, 33, 50, 1000, 1001)]
    ends = []
    for rank in range(world):
        held = [s for s in (_fsdp_shard(x, rank, world) for x in shapes) if _nbytes(s)]
        _, file_sizes = rank_placements([_nbytes(s) for s in held], held, 1, world)
        ends.append(file_sizes[0])
    assert max(ends) == ends[0]


def test_slot_padding_is_written(tmp_path):
    """A slot's padding (a rank past the end of several small tensors: gaps of many alignments)
    reaches the file: every item reads back at its place and the file has its recorded size."""
    from goodput_ckpt.dcp.write_sources import BytesSource
    from goodput_ckpt.engine.hashed_write import write_hashed_files
    from goodput_ckpt.storage import open_store

    world, rank = 8, 7
    shapes = [(rows, 16) for rows in (50, 3, 5, 7, 50, 3, 33)]
    shards = [_fsdp_shard(s, rank, world) for s in shapes]
    sizes = [_nbytes(s) for s in shards]
    assert sizes.count(0) >= 3
    placements, file_sizes = rank_placements(sizes, shards, 1, world)
    gaps = sorted(placements, key=lambda p: p.offset)
    assert max(b.offset - (a.offset + a.length) for a, b in zip(gaps, gaps[1:])) > 2 * ALIGNMENT
    sources = [BytesSource(bytes([i + 1]) * n) for i, n in enumerate(sizes)]
    store = open_store(str(tmp_path), {})
    entries = write_hashed_files(store, ["f.bin"], placements, file_sizes, sources, chunk_size=4096, thread_count=2)
    data = (tmp_path / "f.bin").read_bytes()
    assert len(data) == entries[0].size == file_sizes[0]
    for p in placements:
        assert data[p.offset : p.offset + p.length] == bytes([p.item + 1]) * p.length


@pytest.mark.parametrize("before", [0, 4000, 4096 - 64, 4096 * 3 - 640])
def test_replicated_values_lie_in_one_hash_chunk(before):
    """Rank 0's replicated values (read by every rank at a restore) lie together after its shards,
    moved to the next chunk boundary when they would cross one and fit in one chunk."""
    chunk = 4096
    shards = [ShardShape((before // 4,), (0,), (before // 4,), 4)] if before else []
    own = [1261, 1261, 300]
    sizes = [s.esize * s.sizes[0] for s in shards] + own
    placements, file_sizes = rank_placements(sizes, shards + [None] * len(own), 1, 2, chunk)
    tail = placements[len(shards) :]
    start, end = tail[0].offset, tail[-1].offset + tail[-1].length
    assert start // chunk == (end - 1) // chunk and end == file_sizes[0]
    assert all(a.offset + a.length <= b.offset for a, b in zip(placements, placements[1:]))
    assert start - (before + 63) // 64 * 64 < sum(own) + 3 * 64, "the padding is less than their bytes"


@pytest.mark.parametrize("world", [2, 3, 8])
def test_large_shards_lie_page_aligned_at_one_offset_on_every_rank(world):
    """Items whose slot is at least PAGE_ITEM_MIN start at a page-aligned offset (a staging buffer
    is then written direct where it lies), decided by the slot, which every rank shares, so a
    rank's short last shard (below the threshold) keeps the offset of the full blocks."""
    # Rows of 4,000 bytes (1000 fp32 columns: offsets are no page multiples by themselves), blocks
    # of up to 8 MiB, uneven last shards; 263 * world - 1 rows: a full block of 1,052,000 bytes
    # (over PAGE_ITEM_MIN), the last rank's 262 rows below it.
    rows = [4099, 1025, 7, 16385, 3, 2049, 263 * world - 1]
    shapes = [(r, 1000) for r in rows]
    where: dict[int, set] = {t: set() for t in range(len(shapes))}
    for rank in range(world):
        held = [(t, _fsdp_shard(s, rank, world)) for t, s in enumerate(shapes)]
        held = [(t, s) for t, s in held if _nbytes(s)]
        sizes = [_nbytes(s) for _, s in held]
        placements, _sizes = rank_placements(sizes, [s for _, s in held], 1, world)
        for (t, s), p in zip(held, placements):
            where[t].add(p.offset)
            if shard_slot(s, world) >= PAGE_ITEM_MIN:
                assert p.offset % PAGE == 0, (t, rank, p.offset)
            else:
                assert p.offset % ALIGNMENT == 0
    assert all(len(w) == 1 for w in where.values())
    last, first = _fsdp_shard(shapes[-1], world - 1, world), _fsdp_shard(shapes[-1], 0, world)
    assert _nbytes(last) < PAGE_ITEM_MIN <= shard_slot(first, world)  # the case the slot rule is for


def test_small_items_keep_the_formats_alignment():
    placements, sizes = place_items([100, 70, PAGE_ITEM_MIN, 5], 1)
    assert [p.offset for p in placements] == [0, 128, PAGE, PAGE + PAGE_ITEM_MIN]
    assert sizes == [PAGE + PAGE_ITEM_MIN + 5]
