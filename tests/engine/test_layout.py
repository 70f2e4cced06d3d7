"""Byte layout and chunking of data files."""

from __future__ import annotations

import random

import pytest

from goodput_ckpt.engine.layout import chunk_plans, place_items
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
