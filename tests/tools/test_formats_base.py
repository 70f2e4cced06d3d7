"""The range machinery every converter shares: flat ranges cut into boxes, read from shards."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from goodput_ckpt import CorruptCheckpointError
from goodput_ckpt.tools._formats.base import Box, LoadingCache, TensorMeta, flat_pieces, ordered_map, read_flat


def _boxes_of(full: torch.Tensor, rng: random.Random) -> list[Box]:
    """``full`` cut into shards along a random dimension (or a grid of two), as readers."""
    if full.dim() == 0:
        return [
            Box(
                (),
                (),
                lambda lo, hi, out, t=full: out.__setitem__(
                    slice(None), t.reshape(-1)[lo:hi].view(torch.uint8).numpy().tobytes()
                ),
            )
        ]
    cuts = []
    for d in range(full.dim()):
        n = full.shape[d]
        inner = sorted({rng.randint(0, n) for _ in range(rng.randint(0, 2))}) if rng.random() < 0.6 else []
        cuts.append(sorted({0, n, *inner}))
    boxes = []

    def walk(d, offsets, sizes):
        if d == full.dim():
            piece = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous().reshape(-1)

            def read(lo, hi, out, piece=piece):
                out[:] = piece[lo:hi].view(torch.uint8).numpy().tobytes()

            boxes.append(Box(tuple(offsets), tuple(sizes), read))
            return
        for a, b in zip(cuts[d], cuts[d][1:]):
            walk(d + 1, offsets + [a], sizes + [b - a])

    walk(0, [], [])
    rng.shuffle(boxes)
    return boxes


def test_random_ranges_of_random_shardings_read_exactly():
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 4)))
        full = torch.randint(-1000, 1000, shape or (), dtype=torch.int32)
        meta = TensorMeta("t", torch.int32, shape)
        boxes = _boxes_of(full, rng)
        lo = rng.randint(0, meta.numel)
        hi = rng.randint(lo, meta.numel)
        out = bytearray((hi - lo) * 4)
        read_flat(meta, boxes, lo, hi, memoryview(out))
        got = torch.frombuffer(out, dtype=torch.int32) if out else torch.empty(0, dtype=torch.int32)
        assert torch.equal(got, full.reshape(-1)[lo:hi]), (shape, lo, hi)


def test_pieces_are_few_ordered_and_cover_the_range():
    shape = (4, 5, 6, 7)
    for lo, hi in [(0, 840), (1, 839), (7, 8), (41, 300), (210, 420)]:
        pieces = flat_pieces(shape, lo, hi)
        assert len(pieces) <= 2 * len(shape) - 1
        strides = (210, 42, 7, 1)
        total = 0
        for _prefix, d, a, b in pieces:
            total += (b - a) * strides[d]
        assert total == hi - lo
    assert flat_pieces((3,), 2, 2) == []


def test_a_gap_in_the_shards_is_reported():
    full = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    rows = full[:2].contiguous().reshape(-1)
    box = Box(
        (0, 0),
        (2, 3),
        lambda lo, hi, out: out.__setitem__(slice(None), rows[lo:hi].view(torch.uint8).numpy().tobytes()),
    )
    with pytest.raises(CorruptCheckpointError, match="not covered"):
        read_flat(TensorMeta("t", torch.int32, (4, 3)), [box], 0, 12, memoryview(bytearray(48)))


def test_loading_cache_loads_each_key_once_and_shares_errors():
    calls = []
    gate = threading.Event()

    def load(key):
        calls.append(key)
        gate.wait(5)
        if key == "bad":
            raise ValueError("boom")
        return key * 2

    cache = LoadingCache(2, load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("a"))) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert results == ["aa"] * 4 and calls == ["a"]
    with pytest.raises(ValueError):
        cache.get("bad")
    cache.get("b"), cache.get("c")  # capacity 2: "a" is evicted and loads again
    cache.get("a")
    assert calls.count("a") == 2


def test_ordered_map_keeps_order_and_raises():
    assert list(ordered_map(lambda x: x * x, range(20), threads=3, ahead=4)) == [x * x for x in range(20)]

    def fail(x):
        if x == 5:
            raise RuntimeError("x")
        return x

    with pytest.raises(RuntimeError):
        list(ordered_map(fail, range(10), threads=2, ahead=2))
