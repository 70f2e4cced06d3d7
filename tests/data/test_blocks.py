"""The block pool behind TokenStream: buffers are reused, but never while something views them.

Real files on local disk; the pool's ``allocated`` counter tells how many buffers a pass created."""

from __future__ import annotations

import numpy as np
import pytest

from goodput_ckpt.data import _blocks
from goodput_ckpt.data._blocks import BlockPool

SEQ = 16


def test_a_buffer_is_reused_only_once_nothing_views_it():
    pool = BlockPool(4, SEQ, np.uint16, keep=4)
    buf = pool.take()
    view = buf.rows[1]  # a yielded sequence the caller still holds
    pool.give(buf)
    assert pool.take().rows is not buf.rows, "still viewed: not handed out again"
    del view
    pool.give(pool.take())  # sweeps: buf is free now
    taken = {id(pool.take()) for _ in range(2)}
    assert id(buf) in taken


def test_a_buffer_viewed_past_the_grace_period_is_left_to_its_holder():
    pool = BlockPool(4, SEQ, np.uint16, keep=4)
    buf = pool.take()
    buf.rows.fill_(7)
    kept = buf.rows[:2]
    pool.give(buf)
    for _ in range(_blocks._GRACE + 2):
        other = pool.take()
        other.rows.fill_(9)  # what a read into a reused buffer would do
        pool.give(other)
    assert all(pool.take().rows is not buf.rows for _ in range(4))
    assert bool((kept == 7).all()), "the held view kept its data"


def test_a_buffer_moved_to_shared_memory_is_never_reused():
    """A DataLoader worker moves a sent view's storage to shared memory in place: the main
    process maps those pages, so refilling the buffer would change a batch it holds."""
    pool = BlockPool(4, SEQ, np.uint16, keep=4)
    buf = pool.take()
    buf.rows[:1].share_memory_()  # what pickling a view into a worker queue does
    pool.give(buf)
    for _ in range(_blocks._GRACE + 2):
        assert pool.take().rows is not buf.rows


def test_a_buffers_kept_grouped_view_is_its_own_not_a_holder():
    """``Buffer.grouped`` keeps one 3-D view per batch size: counted as the pool's own, so the
    buffer is still reused once the caller drops its batches, and not while it holds one."""
    pool = BlockPool(6, SEQ, np.uint16, keep=4)
    buf = pool.take()
    assert buf.grouped(3).shape == (2, 3, SEQ) and buf.grouped(3) is buf.grouped(3)
    buf.grouped(2)
    assert buf.free(), "its own views do not hold it"
    batches = buf.grouped(3).unbind(0)
    held = batches[1]
    del batches
    pool.give(buf)
    assert pool.take().rows is not buf.rows, "a batch is held"
    del held
    pool.give(pool.take())
    assert buf in {pool.take() for _ in range(2)}


def test_a_moved_storage_is_told_by_its_address():
    """``Buffer.moved`` (an address compare, cheaper than ``is_shared()``) agrees with torch:
    once the storage is in shared memory, the pool's byte view no longer reaches it."""
    pool = BlockPool(4, SEQ, np.uint16, keep=4)
    buf = pool.take()
    assert not buf.moved() and buf.free()
    buf.rows.fill_(7)
    buf.rows.share_memory_()  # in place, no other view left
    assert buf.rows.is_shared() and buf.moved() and not buf.free()
    buf.bytes[:2] = b"\x05\x00"
    assert int(buf.rows[0, 0]) != 5, "the byte view fills memory no tensor of the pool shows"


def test_a_pass_that_drops_its_items_reuses_a_bounded_number_of_buffers(tmp_path, monkeypatch):
    from goodput_ckpt.data import TokenStream

    names = []
    for k in range(3):
        (tmp_path / f"s{k}.bin").write_bytes(np.arange(50 * SEQ, dtype=np.uint16).tobytes())
        names.append(f"s{k}.bin")
    pools: list[BlockPool] = []
    init = BlockPool.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        pools.append(self)

    monkeypatch.setattr(BlockPool, "__init__", record)
    monkeypatch.setattr(_blocks, "_SPARE", {})  # start with no idle buffers in this process
    for batch in (None, 3):
        n = sum(1 for _ in TokenStream(str(tmp_path), names, seq_len=SEQ, batch_size=batch, block=5, read_ahead=2))
        assert n == (150 if batch is None else 50)
    assert pools[0].allocated <= 2 + 3, "read_ahead + the block consumed + those pending release"
    assert pools[1].allocated == 0, "the next stream takes the first one's idle (and released) buffers"


def test_without_the_reference_count_api_nothing_is_reused(monkeypatch):
    """A torch without ``_storage_Use_Count``: buffers are never handed out twice (slower, safe)."""
    monkeypatch.setattr(_blocks, "_use_count", None)
    pool = BlockPool(4, SEQ, np.uint16, keep=4)
    buf = pool.take()
    pool.give(buf)
    assert all(pool.take().rows is not buf.rows for _ in range(_blocks._GRACE + 2))


def test_each_shard_is_opened_once_whatever_read_ahead(tmp_path):
    """Blocks of one shard share its source, opened at the first read (it was reopened for every
    block when fewer than a shard's blocks were in flight)."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import nullcontext

    from goodput_ckpt.storage import open_store

    store = open_store(str(tmp_path), {})
    for k in range(3):
        (tmp_path / f"s{k}.bin").write_bytes(np.arange(10 * SEQ, dtype=np.uint16).tobytes())
    for ahead in (0, 1, 3):
        opened, sources = [], []

        def open_source(i):
            opened.append(i)
            sources.append(store.open_source(f"s{i}.bin"))
            return sources[-1]

        tasks = [(i, p, min(4, 10 - p), p + 4 >= 10) for i in range(3) for p in range(0, 10, 4)]
        pool = BlockPool(4, SEQ, np.uint16, keep=4)
        with ThreadPoolExecutor(ahead) if ahead else nullcontext() as threads:
            got = [
                (i, p, rows.shape[0])
                for i, p, rows, _buf in _blocks.read_blocks(threads, pool, tasks, open_source, max(ahead, 1), SEQ * 2)
            ]
        assert got == [t[:3] for t in tasks]
        assert opened == [0, 1, 2], f"read_ahead={ahead}: each shard opened once"


def test_a_local_stream_alternates_two_buffers(tmp_path, monkeypatch):
    """Read in the consumer's thread (``read_ahead=0``), a stream whose caller drops its items
    alternates two 4 MiB buffers (8 MiB in all, the plain read's one buffer): each block's buffer is taken before the one consumed is given
    back (the caller still holds its last item), and that one is free again at the next take."""
    from goodput_ckpt.data import TokenStream

    seq = 4096  # uint16: 8 KiB sequences, 512 per 4 MiB block
    names = []
    for k in range(2):
        (tmp_path / f"s{k}.bin").write_bytes(np.zeros(1100 * seq, np.uint16).tobytes())
        names.append(f"s{k}.bin")
    pools: list[BlockPool] = []
    init = BlockPool.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        pools.append(self)

    taken: list[int] = []
    take = BlockPool.take

    def record_take(self, done=None):
        buf = take(self, done)
        taken.append(id(buf))
        return buf

    monkeypatch.setattr(BlockPool, "__init__", record)
    monkeypatch.setattr(BlockPool, "take", record_take)
    monkeypatch.setattr(_blocks, "_SPARE", {})
    for batch in (None, 32):
        taken.clear()
        stream = TokenStream(str(tmp_path), names, seq_len=seq, batch_size=batch, read_ahead=0)
        n = sum(item.shape[0] if batch else 1 for item in stream)
        assert n == 2200
        assert pools[-1]._rows * seq * 2 == 4 << 20, "4 MiB blocks on a local disk"
        assert len(taken) == 6 and len(set(taken)) == 2, "two buffers alternate"


class _CountingSource:
    """A real local source that records each read's (offset, bytes per buffer), and can fail
    the read numbered ``fail_at``."""

    def __init__(self, src, log, fail_at=None):
        self._src, self._log, self._fail_at = src, log, fail_at

    def read_into(self, offset, buffers):
        self._log.append((offset, [memoryview(b).nbytes for b in buffers]))
        if self._fail_at is not None and len(self._log) == self._fail_at:
            raise OSError("injected read failure")
        self._src.read_into(offset, buffers)

    def close(self):
        self._src.close()


def _span_files(tmp_path, lengths):
    for k, n in enumerate(lengths):
        a = np.arange(n * SEQ, dtype=np.uint16).reshape(n, SEQ)
        a[:, 0] = k  # shard index in the first token of every sequence
        (tmp_path / f"s{k}.bin").write_bytes(a.tobytes())


@pytest.mark.parametrize("per_request,ahead", [(1, 4), (2, 4), (3, 4), (4, 4), (3, 7), (4, 2)])
def test_reads_of_several_blocks_fetch_consecutive_blocks_of_one_shard(tmp_path, per_request, ahead):
    """``per_request`` blocks per read: one read per group of consecutive blocks of a shard,
    never across shards, never more than ``per_request`` blocks, and the blocks yielded are
    exactly those a read per block gives, byte for byte."""
    from concurrent.futures import ThreadPoolExecutor

    from goodput_ckpt.storage import open_store

    lengths = [10, 3, 0, 9]
    _span_files(tmp_path, lengths)
    store = open_store(str(tmp_path), {})
    log: list = []
    tasks = [(i, p, min(2, n - p), p + 2 >= n) for i, n in enumerate(lengths) for p in range(0, n, 2)]
    pool = BlockPool(2, SEQ, np.uint16, keep=8)
    taken = [0]
    take = pool.take

    def counted_take(done=None):
        taken[0] += 1
        return take(done)

    pool.take = counted_take
    got, waiting = [], []
    with ThreadPoolExecutor(ahead) as threads:
        for i, p, rows, _buf in _blocks.read_blocks(
            threads,
            pool,
            tasks,
            lambda i: _CountingSource(store.open_source(f"s{i}.bin"), log),
            ahead,
            SEQ * 2,
            per_request,
        ):
            waiting.append(taken[0] - len(got) - 1)  # buffers being read or queued beside this one
            got.append((i, p, rows.clone()))
    assert max(waiting) <= ahead - 1, "no more than read_ahead blocks read ahead at any time"
    assert [(i, p, r.shape[0]) for i, p, r in got] == [t[:3] for t in tasks]
    for i, p, rows in got:
        want = np.arange(p * SEQ, (p + rows.shape[0]) * SEQ, dtype=np.uint16).reshape(-1, SEQ)
        want[:, 0] = i
        assert np.array_equal(rows.numpy(), want), f"shard {i} block at {p}"
    # per shard: ceil(blocks / per_request) reads, each of consecutive whole blocks (no more
    # blocks per read than read_ahead allows)
    per_read = min(per_request, ahead)
    expected = []
    for n in lengths:
        blocks = [min(2, n - p) for p in range(0, n, 2)]
        for g in range(0, len(blocks), per_read):
            group = blocks[g : g + per_read]
            expected.append((g * 2 * SEQ * 2, [k * SEQ * 2 for k in group]))
    assert sorted(log) == sorted(expected)


def test_a_failed_read_of_several_blocks_raises_and_gives_back_every_buffer(tmp_path, monkeypatch):
    """The second read (blocks 2-3 of shard 0) fails: the error reaches the consumer at the
    first of its blocks, after the blocks before it, and every buffer taken is given back
    exactly once (twice would let two reads fill one buffer), so the next pass allocates none."""
    from concurrent.futures import ThreadPoolExecutor

    from goodput_ckpt.storage import open_store

    monkeypatch.setattr(_blocks, "_SPARE", {})  # no idle buffers left by earlier tests
    _span_files(tmp_path, [12])
    store = open_store(str(tmp_path), {})
    tasks = [(0, p, 2, p + 2 >= 12) for p in range(0, 12, 2)]
    pool = BlockPool(2, SEQ, np.uint16, keep=8)
    out: set[int] = set()
    take, give = pool.take, pool.give

    def taken(done=None):
        if done is not None:
            assert id(done) in out, "given back twice"
            out.discard(id(done))
        buf = take(done)
        out.add(id(buf))
        return buf

    def given(buf):
        assert id(buf) in out, "given back twice"
        out.discard(id(buf))
        give(buf)

    pool.take, pool.give = taken, given
    seen = []
    with ThreadPoolExecutor(4) as threads:
        blocks = _blocks.read_blocks(
            threads, pool, tasks, lambda i: _CountingSource(store.open_source("s0.bin"), [], fail_at=2), 4, SEQ * 2, 2
        )
        with pytest.raises(OSError, match="injected"):
            for _i, p, _rows, _buf in blocks:
                seen.append(p)
    assert seen == [0, 2], "the blocks of the first read, then the failed read's error"
    assert not out, "every buffer taken was given back"
    before = pool.allocated
    with ThreadPoolExecutor(4) as threads:
        n = sum(
            1 for _ in _blocks.read_blocks(threads, pool, tasks, lambda i: store.open_source("s0.bin"), 4, SEQ * 2, 2)
        )
    assert n == 6 and pool.allocated == before, "the failed pass's buffers were all given back"
