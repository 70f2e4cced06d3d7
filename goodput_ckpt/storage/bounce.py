"""Page-aligned bounce buffers for ``O_DIRECT`` I/O, reused across calls.

Direct reads (:mod:`.direct_read`) and direct writes (:mod:`.direct_write`) both move bytes
through page-aligned memory, since ``O_DIRECT`` wants aligned addresses and the tensors' own
memory rarely is. The buffers are anonymous ``mmap``s (page-aligned by construction) kept in a
pool: reuse matters, because a fresh buffer is page-faulted on first touch, which costs more
than the copy itself.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

__all__ = ["BouncePool", "address_of"]


class BouncePool:
    """Buffers of ``size`` bytes; at most ``keep`` idle ones are kept between uses (the rest are
    unmapped), so a process holds at most ``size * keep`` bytes while it does no I/O."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._lock = threading.Lock()  # I/O threads take and return buffers concurrently
        self._idle: list[mmap.mmap] = []

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return mmap.mmap(-1, self.size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buf)
                return
        buf.close()


def address_of(view: memoryview) -> int:
    """The address of a writable view's first byte (0 for an empty view, which has none)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
