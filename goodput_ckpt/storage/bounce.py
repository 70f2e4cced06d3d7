"""Page-aligned bounce buffers for ``O_DIRECT`` I/O, reused across calls, released when idle.

Direct reads (:mod:`.direct_read`) and direct writes (:mod:`.direct_write`) both move bytes
through page-aligned memory, since ``O_DIRECT`` wants aligned addresses and the tensors' own
memory rarely is. The buffers are anonymous ``mmap``s (page-aligned by construction) kept in a
pool: reuse matters, because a fresh buffer is page-faulted on first touch, which costs more
than the copy itself. Reuse matters within a save (one buffer per chunk otherwise) and between
saves that follow each other closely (a save every few steps), but a process that saved once an
hour would otherwise hold the pool (64 MiB for direct writes) for the rest of its life: idle
buffers are unmapped once no buffer has been used for :data:`IDLE_SECONDS`, by a timer thread that
exists only while buffers are idle and not yet released.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref

__all__ = ["IDLE_SECONDS", "BouncePool", "address_of"]

#: Seconds with no buffer in use after which a pool unmaps its idle buffers. Refaulting a pool's
#: buffers costs a save about 10-20 ms (32-64 MiB of zeroed pages), which is noise for saves more
#: than this far apart, and saves closer together keep their buffers.
IDLE_SECONDS = 30.0


class BouncePool:
    """Buffers of ``size`` bytes; at most ``keep`` idle ones are kept between uses (the rest are
    unmapped), so a process holds at most ``size * keep`` bytes while it does no I/O, and none
    once no buffer has been used for ``idle_seconds`` (``None``: kept for the process's life)."""

    def __init__(self, size: int, keep: int, idle_seconds: float | None = IDLE_SECONDS) -> None:
        self.size = size
        self.keep = keep
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()  # I/O threads take and return buffers concurrently
        self._idle: list[mmap.mmap] = []
        self._in_use = 0
        self._last_use = 0.0  # time.monotonic() of the last give
        self._timer: threading.Timer | None = None
        if hasattr(os, "register_at_fork"):
            ref = weakref.WeakMethod(self._after_fork_in_child)
            os.register_at_fork(after_in_child=lambda: (m := ref()) is not None and m())

    def _after_fork_in_child(self) -> None:
        """A forked child (a data-loader worker) has none of the parent's threads: its lock may
        be held by one of them and its timer does not run there. Start afresh."""
        self._lock = threading.Lock()
        self._in_use = 0
        self._timer = None
        if self._idle:
            self._arm(self.idle_seconds)

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle buffers held now."""
        with self._lock:
            return len(self._idle) * self.size

    @property
    def pending_release(self) -> threading.Timer | None:
        """The timer that will release the idle buffers, while one is armed (tests join it)."""
        return self._timer

    def take(self) -> mmap.mmap:
        with self._lock:
            self._in_use += 1
            if self._idle:
                return self._idle.pop()
        try:
            return mmap.mmap(-1, self.size)
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._in_use = max(0, self._in_use - 1)  # 0 floor: a forked child's count starts at 0
            self._last_use = time.monotonic()
            kept = len(self._idle) < self.keep
            if kept:
                self._idle.append(buf)
            if self._in_use == 0 and self._idle:
                self._arm(self.idle_seconds)
        if not kept:
            buf.close()

    def release_idle(self) -> int:
        """Unmap every idle buffer now; returns how many bytes were released."""
        with self._lock:
            idle, self._idle = self._idle, []
        for buf in idle:
            buf.close()
        return len(idle) * self.size

    def _arm(self, delay: float | None) -> None:
        """Start the release timer unless one is armed (called with the lock held)."""
        if delay is None or self._timer is not None:
            return
        timer = threading.Timer(delay, self._on_timer)
        timer.daemon = True
        self._timer = timer
        timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            if self._in_use or not self._idle or self.idle_seconds is None:
                return  # in use again: the give that ends this use arms a new timer
            left = self._last_use + self.idle_seconds - time.monotonic()
            if left > 0:  # used since this timer was armed: wait for the rest of the idle time
                self._arm(left)
                return
            idle, self._idle = self._idle, []
        for buf in idle:
            buf.close()


def address_of(view: memoryview) -> int:
    """The address of a writable view's first byte (0 for an empty view, which has none)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
