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


class BlockPool:
    """Reused ``(rows, seq_len)`` buffers, page-aligned (a direct read lands in them as is).

    Idle buffers are kept per process (:data:`_SPARE`), at most ``keep`` of each shape, so a
    stream made for the next epoch or stretch reuses the last one's buffers instead of faulting
    in new ones. Buffers handed out and not given back are not counted (the reads in flight and
    the block being consumed), so a stream's memory is its ``read_ahead`` reads, the block it
    consumes, the ones pending release, and the idle ones.
    """

    def __init__(self, rows: int, seq_len: int, dtype: Any, keep: int) -> None:
        self._rows, self._seq_len, self._dtype, self._keep = rows, seq_len, np.dtype(dtype), keep
        spare = _SPARE.setdefault((rows, seq_len, self._dtype.str), ([], deque()))
        self._idle: list[tuple[torch.Tensor, int]] = spare[0]  # (buffer, its storage's count when only the pool holds it)
        # (buffer, count, checks left); shared, so that a block still viewed when its stream
        # ended is reused by a later stream once let go
        self._pending: deque[tuple[torch.Tensor, int, int]] = spare[1]
        self.allocated = 0  # buffers this pool created (for tests and benchmarks)

    def _new(self) -> tuple[torch.Tensor, int]:
        nbytes = self._rows * self._seq_len * self._dtype.itemsize
        raw = np.empty(nbytes + ALIGN, np.uint8)
        skip = -raw.ctypes.data % ALIGN
        buf = torch.from_numpy(raw[skip : skip + nbytes].view(self._dtype).reshape(self._rows, self._seq_len))
        del raw
        self.allocated += 1
        return buf, _count(buf)

    def take(self) -> tuple[torch.Tensor, int]:
        """A buffer nobody else views (an idle one, a released one now free, or a new one)."""
        self._sweep()
        with _SPARE_LOCK:
            if self._idle:
                return self._idle.pop()
        return self._new()

    def give(self, buf: torch.Tensor, count: int) -> None:
        """Release a buffer taken earlier; it is reused once nothing else views it."""
        with _SPARE_LOCK:
            self._pending.append((buf, count, _GRACE))

    def _sweep(self) -> None:
        with _SPARE_LOCK:
            for _ in range(len(self._pending)):
                buf, count, left = self._pending.popleft()
                if _use_count is not None and _count(buf) == count and not buf.is_shared():
                    if len(self._idle) < self._keep:
                        self._idle.append((buf, count))
                elif left > 1 and not buf.is_shared():
                    self._pending.append((buf, count, left - 1))
                # else: still viewed (or in shared memory): its holders keep it; the pool forgets it


#: Idle and released buffers of this process by (rows, seq_len, dtype), shared by the streams it
#: iterates (one after another, or interleaved in one loop); ``_SPARE_LOCK`` because a loader
#: may iterate streams from more than one thread.
_SPARE: dict[tuple[int, int, str], tuple[list[tuple[torch.Tensor, int]], deque[tuple[torch.Tensor, int, int]]]] = {}
_SPARE_LOCK = threading.Lock()


def _count(buf: torch.Tensor) -> int:
    """The storage's reference count (views included), or -1 without the API (then
    :meth:`BlockPool._sweep` reuses nothing)."""
    if _use_count is None:
        return -1
    return _use_count(buf.untyped_storage()._cdata)


def read_blocks(
    pool: ThreadPoolExecutor,
    blocks: BlockPool,
    tasks: Iterable[tuple[int, int, int, bool]],
    open_source: Callable[[int], Any],
    read_ahead: int,
    seq_bytes: int,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(shard, first sequence, rows)`` for each ``(shard, first sequence, count, last)``
    task in order (``last``: the shard's final block), with up to ``read_ahead`` reads in flight whatever shard they belong to (``pool`` an
    :class:`InlineReads` and ``read_ahead`` 1: each block read when it is asked for).

    ``rows`` is a view of a pooled buffer; it is given back to the pool when the next block is
    requested (so the caller must be done with it, except for views it yielded onward: see the
    module docstring). A shard's source is opened at its first read and closed once its last
    block was handed over (once per shard, whatever ``read_ahead``), or when the generator is
    closed.
    """
    it = iter(tasks)
    ahead: deque[tuple[int, int, int, bool, tuple[torch.Tensor, int], Future]] = deque()
    sources: dict[int, Any] = {}
    current: tuple[torch.Tensor, int] | None = None
    try:
        while True:
            while len(ahead) < read_ahead and (task := next(it, None)) is not None:
                shard, pos, k, last = task
                if shard not in sources:
                    sources[shard] = open_source(shard)
                buf = blocks.take()
                ahead.append((shard, pos, k, last, buf, pool.submit(_read, sources[shard], buf[0], pos * seq_bytes, k)))
            if not ahead:
                return
            shard, pos, k, last, buf, fut = ahead.popleft()
            fut.result()
            if last:
                sources.pop(shard).close()
            if current is not None:
                blocks.give(*current)
            current = buf
            yield shard, pos, buf[0][:k]
    finally:
        for *_, fut in ahead:
            if not fut.cancel():
                fut.exception()  # let a running read finish before closing its source
        for src in sources.values():
            src.close()
        if current is not None:
            blocks.give(*current)  # the next stream (epoch, stretch) reuses it
        for *_, buf, _ in ahead:
            blocks.give(*buf)  # its read was cancelled or has finished (above)


class InlineReads:
    """An executor that runs each read at once in the calling thread (``read_ahead=0``): for a
    local disk, whose kernel readahead already overlaps the device with the consumer, helper
    threads measured no faster (docs/benchmarks.md) and cost threads."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # raised again by result(), where the stream takes the block
            fut.set_exception(e)
        return fut


def _read(src: Any, buf: torch.Tensor, offset: int, k: int) -> None:
    """Fill the first ``k`` rows of ``buf`` from ``offset`` (a helper thread; GIL released in I/O)."""
    view = memoryview(buf.numpy()).cast("B")
    src.read_into(offset, [view[: k * buf.shape[1] * buf.element_size()]])
