"""Blocks of token sequences read ahead across shard boundaries into a bounded pool of reused buffers.

Why a pool: a fresh 8 MiB buffer per block is page-faulted on first touch, which measured slower
than the read itself from the page cache (benchmarks/bench_tokens.py, docs/benchmarks.md). Why
across shards: with one pipeline per shard, the reads in flight drain at the end of every shard
and the consumer waits for the first block of the next one.

**Ownership.** The stream yields views of these buffers (a copy would cost as much as the read).
A buffer is refilled only when nothing but the pool views it: its storage's reference count is
back to what the pool's own tensor holds, and it was never moved to shared memory (a
``DataLoader`` worker does that in place when it sends a view to the main process, which then
maps the same pages). A buffer still viewed after a grace period is dropped from the pool and
left to its holders, so tensors a caller keeps never see their data change; the pool allocates a
new buffer instead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..storage.direct_read import ALIGN

__all__ = ["BlockPool", "read_blocks"]

#: ``torch._C._storage_Use_Count``: the reference count of a tensor's storage (views included).
#: Without it (a future torch) no buffer is ever reused: correct, only slower.
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

#: Checks a released buffer may stay viewed before the pool gives it up. The caller's loop
#: variable holds the last yielded view of a block until the next item is yielded, and a loader
#: collating per-sequence items holds up to a batch of them, so a block freshly consumed is
#: usually still viewed at the first check and free at the next.
_GRACE = 2


class Buffer:
    """One pooled ``(rows, seq_len)`` buffer, with what each block read needs precomputed: the
    byte view a read fills (a new ``memoryview`` per block cost about 2 us), the storage's
    handle and reference count when only the pool holds it (checked without creating a Python
    storage object), and the address of the pool's memory."""

    __slots__ = ("rows", "bytes", "_cdata", "_count", "_ptr", "_grouped")

    def __init__(self, rows: int, seq_len: int, dtype: np.dtype) -> None:
        nbytes = rows * seq_len * dtype.itemsize
        raw = np.empty(nbytes + ALIGN, np.uint8)
        skip = -raw.ctypes.data % ALIGN
        data = raw[skip : skip + nbytes]
        self.rows = torch.from_numpy(data.view(dtype).reshape(rows, seq_len))
        self.bytes = memoryview(data)  # the same memory (never moved: see free())
        self._cdata = self.rows.untyped_storage()._cdata
        self._count = self._use()
        self._ptr = self.rows.data_ptr()
        self._grouped: dict[int, torch.Tensor] = {}

    def grouped(self, size: int) -> torch.Tensor:
        """All rows as a ``(rows // size, size, seq_len)`` view (``size`` must divide the rows),
        made once per size and kept (a ``view`` call costs about 1.7 us per block). Never yielded
        itself (only its ``unbind`` views are), so no caller can hold or change it; the pool
        counts it among its own references to the storage."""
        view = self._grouped.get(size)
        if view is None:
            view = self._grouped[size] = self.rows.view(-1, size, self.rows.shape[1])
            self._count += 1  # one more storage reference of the pool's own (taken: no sweep sees it now)
        return view

    def _use(self) -> int:
        return -1 if _use_count is None else _use_count(self._cdata)

    def moved(self) -> bool:
        """Whether the storage left the pool's memory: a worker moves a sent view's storage to
        shared memory in place (a new allocation, the data copied), so the pool's byte view no
        longer reaches it, and the main process maps those pages. Compared by address: about
        0.1 us, where ``is_shared()`` cost 1.6 us per block."""
        return self.rows.data_ptr() != self._ptr

    def free(self) -> bool:
        """Whether nothing but the pool views the buffer, and its storage is still the pool's
        memory (:meth:`moved`)."""
        return _use_count is not None and self._use() == self._count and not self.moved()


class BlockPool:
    """Reused ``(rows, seq_len)`` buffers (:class:`Buffer`), page-aligned (a direct read lands in
    them as is, and the kernel's copy into a destination not 32-byte aligned measured 2.4x slower
    on the development machine's AMD EPYC).

    Idle buffers are kept per process (:data:`_SPARE`), at most ``keep`` of each shape, so a
    stream made for the next epoch or stretch reuses the last one's buffers instead of faulting
    in new ones. Buffers handed out and not given back are not counted (the reads in flight and
    the block being consumed), so a stream's memory is its ``read_ahead`` reads, the block it
    consumes, the ones pending release, and the idle ones. A stream that reads in the consumer's
    thread takes each block's buffer before giving back the one consumed (the caller still holds
    its last item), so two buffers alternate.
    """

    def __init__(self, rows: int, seq_len: int, dtype: Any, keep: int) -> None:
        self._rows, self._seq_len, self._dtype, self._keep = rows, seq_len, np.dtype(dtype), keep
        spare = _SPARE.setdefault((rows, seq_len, self._dtype.str), ([], deque()))
        self._idle: list[Buffer] = spare[0]
        # (buffer, checks left); shared, so that a block still viewed when its stream ended is
        # reused by a later stream once let go
        self._pending: deque[tuple[Buffer, int]] = spare[1]
        self.allocated = 0  # buffers this pool created (for tests and benchmarks)

    def take(self, done: Buffer | None = None) -> Buffer:
        """A buffer nobody else views (an idle one, a released one now free, or a new one);
        ``done``: a buffer to release (:meth:`give`) once the new one is taken, under the same
        lock."""
        with _SPARE_LOCK:
            if self._pending:
                self._sweep()
            buf = self._idle.pop() if self._idle else None
            if done is not None:
                self._pending.append((done, _GRACE))
        if buf is None:
            self.allocated += 1
            buf = Buffer(self._rows, self._seq_len, self._dtype)
        return buf

    def give(self, buf: Buffer) -> None:
        """Release a buffer taken earlier; it is reused once nothing else views it."""
        with _SPARE_LOCK:
            self._pending.append((buf, _GRACE))

    def _sweep(self) -> None:
        """Move released buffers now free to the idle list (under ``_SPARE_LOCK``)."""
        for _ in range(len(self._pending)):
            buf, left = self._pending.popleft()
            if buf.free():
                if len(self._idle) < self._keep:
                    self._idle.append(buf)
            elif left > 1 and not buf.moved():
                self._pending.append((buf, left - 1))
            # else: still viewed (or in shared memory): its holders keep it; the pool forgets it


#: Idle and released buffers of this process by (rows, seq_len, dtype), shared by the streams it
#: iterates (one after another, or interleaved in one loop); ``_SPARE_LOCK`` because a loader
#: may iterate streams from more than one thread.
_SPARE: dict[tuple[int, int, str], tuple[list[Buffer], deque[tuple[Buffer, int]]]] = {}
_SPARE_LOCK = threading.Lock()


def read_blocks(
    threads: ThreadPoolExecutor | None,
    blocks: BlockPool,
    tasks: Iterable[tuple[int, int, int, bool]],
    open_source: Callable[[int], Any],
    read_ahead: int,
    seq_bytes: int,
    per_request: int = 1,
) -> Iterator[tuple[int, int, torch.Tensor, Buffer]]:
    """Yield ``(shard, first sequence, rows, buffer)`` for each ``(shard, first sequence, count,
    last)`` task in order (``last``: the shard's final block), with up to ``read_ahead`` blocks
    read ahead on ``threads`` whatever shard they belong to, ``per_request`` consecutive blocks of
    a shard fetched by one read (one request of a remote store, streamed into their buffers in
    turn); ``threads`` None: each block is read in the calling thread when it is asked for
    (``read_ahead`` and ``per_request`` ignored).

    ``rows`` is the pooled ``buffer``'s ``rows``, or its first ``count`` of them; the buffer is
    given back to the pool when the next block is requested (so the caller must be done with
    both, except for views it yielded onward: see the module docstring). A shard's source is
    opened at its first read and closed once its last block was handed over (once per shard,
    whatever ``read_ahead``), or when the generator is closed.
    """
    if threads is None:
        return _read_inline(blocks, tasks, open_source, seq_bytes)
    return _read_ahead(threads, blocks, tasks, open_source, read_ahead, seq_bytes, per_request)


def _read_inline(
    blocks: BlockPool, tasks: Iterable[tuple[int, int, int, bool]], open_source: Callable[[int], Any], seq_bytes: int
) -> Iterator[tuple[int, int, torch.Tensor, Buffer]]:
    """:func:`read_blocks` without helper threads: the per-block work is kept to the read and
    a few operations (no futures; at 4 MiB blocks read from the page cache, each microsecond per
    block is about 0.3% of the read)."""
    src, src_shard = None, -1
    current: Buffer | None = None
    full = blocks._rows
    try:
        for shard, pos, k, last in tasks:
            if shard != src_shard:
                if src is not None:
                    src.close()
                    src = None
                src, src_shard = open_source(shard), shard
            # the block consumed is released as the next buffer is taken: the caller still holds
            # its last item, so two buffers alternate
            buf, current = blocks.take(current), None
            try:
                src.read_into(pos * seq_bytes, [buf.bytes[: k * seq_bytes] if k < full else buf.bytes])
            except BaseException:
                blocks.give(buf)
                raise
            if last:
                src.close()
                src, src_shard = None, -1
            current = buf
            yield shard, pos, buf.rows if k == full else buf.rows[:k], buf
    finally:
        if src is not None:
            src.close()
        if current is not None:
            blocks.give(current)  # the next stream (epoch, stretch) reuses it


def _read_ahead(
    threads: ThreadPoolExecutor,
    blocks: BlockPool,
    tasks: Iterable[tuple[int, int, int, bool]],
    open_source: Callable[[int], Any],
    read_ahead: int,
    seq_bytes: int,
    per_request: int,
) -> Iterator[tuple[int, int, torch.Tensor, Buffer]]:
    """:func:`read_blocks` with up to ``read_ahead`` blocks read ahead on helper threads, in
    reads of up to ``per_request`` blocks. A read is queued once all its blocks have room, so no
    more than ``read_ahead`` buffers are ever being filled or waiting to be consumed."""
    per_request = max(1, min(per_request, read_ahead))
    requests = _requests(iter(tasks), per_request)
    ahead: deque[tuple[int, int, int, bool, Buffer, Future]] = deque()
    sources: dict[int, Any] = {}
    current: Buffer | None = None
    try:
        while True:
            while len(ahead) + per_request <= read_ahead and (group := next(requests, None)) is not None:
                shard, first = group[0][0], group[0][1]
                if shard not in sources:
                    sources[shard] = open_source(shard)
                bufs: list[Buffer] = []
                try:
                    bufs.extend(blocks.take() for _ in group)
                    dest = [buf.bytes[: k * seq_bytes] for buf, (_, _, k, _) in zip(bufs, group)]
                    read = threads.submit(sources[shard].read_into, first * seq_bytes, dest)
                except BaseException:
                    for buf in bufs:  # not queued: nothing else gives them back
                        blocks.give(buf)
                    raise
                ahead.extend((*task, buf, read) for task, buf in zip(group, bufs))
            if not ahead:
                return
            shard, pos, k, last, buf, fut = ahead.popleft()
            try:
                fut.result()
            except BaseException:
                blocks.give(buf)
                raise
            if last:
                sources.pop(shard).close()
            if current is not None:
                blocks.give(current)
            current = buf
            rows = buf.rows
            yield shard, pos, rows if k == rows.shape[0] else rows[:k], buf
    finally:
        for *_, fut in ahead:  # a read of several blocks appears once per block: cancel is idempotent
            if not fut.cancel():
                fut.exception()  # let a running read finish before closing its source
        for src in sources.values():
            src.close()
        if current is not None:
            blocks.give(current)  # the next stream (epoch, stretch) reuses it
        for *_, buf, _ in ahead:
            blocks.give(buf)  # its read was cancelled or has finished (above)


def _requests(
    tasks: Iterator[tuple[int, int, int, bool]], per_request: int
) -> Iterator[list[tuple[int, int, int, bool]]]:
    """The tasks in groups of up to ``per_request`` that one read can fetch: consecutive blocks
    of one shard, each starting where the one before ended, a group ending at its shard's last
    block."""
    group: list[tuple[int, int, int, bool]] = []
    for task in tasks:
        if group and (task[0] != group[-1][0] or task[1] != group[-1][1] + group[-1][2]):
            yield group  # not contiguous with the group (no caller makes such tasks today)
            group = []
        group.append(task)
        if task[3] or len(group) == per_request:
            yield group  # at once: waiting for the next task would read the next shard's start early
            group = []
    if group:
        yield group
