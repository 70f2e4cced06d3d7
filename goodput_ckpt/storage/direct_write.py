"""Writing data files around the page cache (``O_DIRECT``) on local disks.

A buffered write copies every byte into the page cache, and the kernel first has to find a page
for it: on the development machine (a VM whose free memory goes back to its host) that page
allocation is most of a buffered save's CPU, and it grows as kept checkpoints fill the cache.
Measured there beside a training loop (48 MiB saves, 12 interleaved rounds), the writer threads
used 34-163 CPU-ms per save (median 88) buffered against 26-48 (median 30) direct, hashing
included (docs/benchmarks.md, "A whole training loop"). Direct writes move the bytes from a
reused, page-aligned bounce buffer to the device, so a save's CPU is one ``memmove`` into that
buffer (GIL released) and the hash over it, and its wall time is the device's. A save on its own
was faster buffered there while the CPUs had room (the page cache takes the bytes at memory
speed) and faster direct when they were contended, so the local store writes direct for saves
that run beside training and, for a save the caller waits for, when :mod:`.write_mode` finds
the CPUs or memory under pressure (``LocalConfig.direct_writes``).

How a chunk is written (:meth:`DirectWriter.write_hashed`): its buffers are copied into a bounce
buffer from :class:`.bounce.BouncePool`, hashed there (while in the CPU cache), and written with
``pwrite`` on an ``O_DIRECT`` descriptor of the same file. A device wants the offset, the length
and the buffer address aligned (:data:`~.direct_read.ALIGN`); the bounce buffer is aligned, chunk
offsets are multiples of the chunk size, and the unaligned tail of a file's last chunk (less than
one block) is written through the sink's buffered descriptor. A chunk at an unaligned offset, or
any write after a refusal (``EINVAL``, ``EOPNOTSUPP``: a filesystem or device that takes no direct writes), is
written buffered: the result is the same file, only slower. A chunk that is one page-aligned
buffer (the manager's staging buffers are allocated so, and pinned host memory is) skips the
bounce buffer: it is written and hashed where it lies.

The trade-off: a checkpoint written directly is not in the page cache, so a load right after it
reads the device (a load in a new process after a crash usually does anyway, and a save no longer
evicts the training job's cached data to make room for itself).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

from .base import Buffer
from .bounce import BouncePool, address_of
from .direct_read import ALIGN

__all__ = ["DirectWriter", "open_direct"]

#: ``O_DIRECT`` where the platform has it (Linux); 0 elsewhere (then writes are buffered).
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bytes per bounce buffer (and at most per direct ``pwrite``): one default chunk, so a chunk is
#: copied, hashed and written in one piece. Larger chunks go through in pieces of this size.
BOUNCE_BYTES = 8 << 20
#: Idle bounce buffers kept for later chunks and later saves (one per writer thread is enough):
#: a fresh buffer is page-faulted on first touch, which costs more than the copy. At most
#: 8 x 8 MiB stay allocated in the process between saves, and none once no direct write has run
#: for :data:`.bounce.IDLE_SECONDS`.
_BOUNCE_KEEP = 8
#: Buffers at least this large are copied with ``memmove`` through ctypes (GIL released); smaller
#: ones (alignment padding, pickled values) by a slice assignment.
_MEMMOVE_MIN = 64 << 10
#: Page-aligned buffers at least this large are written from their own memory, with no copy into
#: a bounce buffer: the copy was a quarter of a direct save's CPU (27 ms per 256 MiB against
#: blake3's 57 ms on the development machine). The bytes hashed are the bytes written, read from
#: the same memory, as a buffered write's are.
_IN_PLACE_MIN = 256 << 10
#: What a filesystem or device answers to a direct write it does not take (then: buffered).
_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


_POOL = BouncePool(BOUNCE_BYTES, _BOUNCE_KEEP)


def _in_place(view: memoryview, pos: int) -> bool:
    """Whether ``view`` is written where it lies, at file position ``pos``: a large buffer whose
    address and position are page-aligned (a manager's staging buffer, pinned host memory). A
    smaller one costs less to copy than a write call of its own."""
    return view.nbytes >= _IN_PLACE_MIN and not view.readonly and pos % ALIGN == 0 and address_of(view) % ALIGN == 0


def open_direct(fd: int) -> int | None:
    """A second, ``O_DIRECT`` descriptor of the file open as ``fd`` (reopened through
    ``/proc/self/fd``, so it is the same inode whatever happens to its name), or ``None`` where
    the platform or the filesystem takes no direct writes (tmpfs: ``EINVAL``)."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return None


class DirectWriter:
    """Writes chunks of one file through its ``O_DIRECT`` descriptor ``dfd``.

    Args:
        dfd: the direct descriptor (:func:`open_direct`); owned by this object.
        buffered: ``write(offset, buffers)``, the sink's buffered write, for what cannot go direct.
    """

    def __init__(self, dfd: int, buffered: Any) -> None:
        self._dfd = dfd
        self._buffered = buffered
        self.refused = False  # a direct write was refused: the rest of the file goes buffered

    def write_hashed(self, offset: int, buffers: Sequence[Buffer], hasher: Any) -> bool:
        """Hash ``buffers`` and write them at ``offset``, in order: each large page-aligned buffer
        at a page-aligned file position where it lies, everything else copied into a bounce
        buffer and hashed there.

        Returns:
            ``False`` when nothing was written (an unaligned offset, or direct writes refused):
            the caller then hashes and writes the chunk buffered.

        Raises:
            OSError: the write failed for another reason than a refusal.
        """
        if self.refused or offset % ALIGN:
            return False
        views = [memoryview(b).cast("B") for b in buffers]
        bounce: Any = None
        bview: memoryview | None = None
        base = 0
        pos = offset  # the file position of the bounce buffer's first byte
        piece = 0  # bytes in the bounce buffer
        try:
            for v in views:
                done = 0
                if _in_place(v, pos + piece):
                    if piece:
                        if not self._write_piece(bview, piece, pos, hasher):  # type: ignore[arg-type]
                            return self._refused_at(pos, offset, views, hasher)
                        pos += piece
                        piece = 0
                    head = v.nbytes - v.nbytes % ALIGN  # its unaligned tail goes through the bounce buffer
                    while done < head:
                        n = min(head - done, BOUNCE_BYTES)
                        if not self._write_piece(v[done:], n, pos, hasher):
                            return self._refused_at(pos, offset, views, hasher)
                        pos += n
                        done += n
                while done < v.nbytes:
                    if bview is None:
                        bounce = _POOL.take()
                        bview = memoryview(bounce)
                        base = address_of(bview)
                    n = min(v.nbytes - done, BOUNCE_BYTES - piece)
                    part = v[done : done + n]
                    if n >= _MEMMOVE_MIN and not part.readonly:
                        ctypes.memmove(base + piece, address_of(part), n)
                    else:
                        bview[piece : piece + n] = part
                    piece += n
                    done += n
                    if piece == BOUNCE_BYTES:
                        if not self._write_piece(bview, piece, pos, hasher):
                            return self._refused_at(pos, offset, views, hasher)
                        pos += piece
                        piece = 0
            if piece and not self._write_piece(bview, piece, pos, hasher):  # type: ignore[arg-type]
                return self._refused_at(pos, offset, views, hasher)
            return True
        finally:
            if bview is not None:
                del bview
                _POOL.give(bounce)

    def _write_piece(self, bview: memoryview, n: int, pos: int, hasher: Any) -> bool:
        """Hash ``bview[:n]`` and write it at ``pos``: the aligned head direct, a tail of less
        than one block buffered. ``False`` (nothing hashed) when the direct write was refused."""
        head = n - n % ALIGN
        done = 0
        try:
            while done < head:  # a short direct write stops at a block boundary: go on from it
                written = os.pwrite(self._dfd, bview[done:head], pos + done)
                if written <= 0:
                    raise OSError(errno.EIO, f"a direct write at offset {pos + done} wrote nothing")
                done += written
        except OSError as e:
            if e.errno not in _REFUSALS or done:
                raise
            self.refused = True
            return False
        hasher.update(bview[:n])
        if n > head:
            self._buffered(pos + head, [bview[head:n]])
        return True

    def _refused_at(self, pos: int, offset: int, views: Sequence[memoryview], hasher: Any) -> bool:
        """The first direct write refused: with nothing written and hashed yet, the caller writes
        the whole chunk buffered; pieces already written direct are a bug in the sizes above."""
        if pos != offset:  # pragma: no cover - a device that took one aligned write and refused the next
            raise OSError(errno.EINVAL, "a direct write was refused after an earlier one succeeded")
        return False

    def close(self) -> None:
        os.close(self._dfd)
