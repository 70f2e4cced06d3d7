"""Reading data files around the page cache (``O_DIRECT``), for local disks and mounted volumes.

A checkpoint is read once. A buffered read costs a kernel copy out of the page cache plus the
page cache's own bookkeeping (allocation, readahead, LRU), on the same cores that hash the bytes
and run training; a direct read moves the bytes from the device (or a FUSE daemon) straight into
user memory. One implementation serves both stores that read files by path:

- ``unaligned`` direct reads (mounted volumes): FUSE and network filesystems take any offset,
  length and buffer address, so each read lands in the destination as it is.
- ``aligned`` direct reads (local disks, and volumes that refused an unaligned one): a block
  device wants the file offset, the length and the buffer address aligned to its block size.
  A read whose offset and buffers are all :data:`ALIGN`-aligned goes straight into the
  destination; any other is read through a reused, page-aligned bounce buffer (:class:`.bounce.BouncePool`)
  covering the aligned window around it, then copied into the destination. Torch places large
  tensors 64 bytes past a page boundary, so most destinations take the bounce: one memcpy, which
  measured cheaper than the page cache's copy and bookkeeping (docs/benchmarks.md).
- ``buffered`` reads: a filesystem that refuses ``O_DIRECT`` at open (``EINVAL``: older tmpfs) or
  refuses a direct read (``EINVAL``) drops one level (unaligned -> aligned -> buffered) for the
  rest of the file, and the refused range is read again.

Every level fills the caller's buffers exactly; hashing happens once, above, over the destination.
Descriptors are opened with ``O_NOFOLLOW`` on a path the store has already checked.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence

from ..errors import CheckpointError
from .base import Buffer, drop_done, missing_file_error, truncated_error
from .bounce import BouncePool, address_of

__all__ = ["ALIGN", "DirectSource", "read_full"]

#: ``O_DIRECT`` where the platform has it (Linux); 0 elsewhere (then reads are buffered).
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Alignment of offsets, lengths and addresses of aligned direct reads: 4096 covers 512-byte
#: and 4 KiB-sector devices alike (a device wanting more refuses, and the file reads buffered).
ALIGN = 4096
#: Bytes per bounce buffer: several reads in flight per thread are not needed (the reader runs
#: many threads), and 4 MiB is large enough that a request's overhead is small.
_BOUNCE_BYTES = 4 << 20
#: Idle bounce buffers kept for later reads and later loads (one per reader thread is enough).
_BOUNCE_KEEP = 16
#: Linux caps an iovec array at IOV_MAX (1024); stay below it.
_MAX_IOV = 512

_LEVELS = ("unaligned", "aligned", "buffered")


def os_error(exc: OSError, what: str, path: str) -> CheckpointError:
    """Translate an ``OSError`` into a :class:`CheckpointError` with advice: the one table, for
    every store that works on POSIX files (local disk, volumes, their direct reads)."""
    hint = {
        errno.ENOSPC: "the disk is full: free space or save elsewhere",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EFBIG: "the file exceeds the file-size limit (ulimit -f) of this process",
        errno.EACCES: "permission denied: check the ownership of the location",
        errno.EPERM: "operation not permitted on this filesystem",
        errno.EROFS: "the filesystem is read-only",
        errno.ENOENT: "no such file or directory",
        errno.ESPIPE: "this filesystem only takes writes in order (a mounted object store?): save with volume=True",
    }.get(exc.errno or -1, exc.strerror or "I/O error")
    return CheckpointError(f"{what} {path} failed: {hint} ({exc})", path=path)


def read_full(fd: int, path: str, offset: int, buffers: Sequence[Buffer]) -> int:
    """Fill ``buffers`` from ``fd`` starting at ``offset`` with ``preadv`` (GIL released).

    Returns:
        The bytes read: the buffers' total size.

    Raises:
        IncompleteCheckpointError: the file ends before the buffers are full (``path`` and the
            byte range are named).
        CheckpointError: any other ``OSError``.
    """
    start = offset
    views = [memoryview(b).cast("B") for b in buffers]  # once: each costs about 0.2 us
    total = views[0].nbytes if len(views) == 1 else sum(v.nbytes for v in views)
    try:
        for i in range(0, len(views), _MAX_IOV):
            batch = views[i : i + _MAX_IOV]
            while batch:
                got = os.preadv(fd, batch, offset)
                if got == 0:
                    raise truncated_error(path, start, start + total, offset)
                offset += got
                drop_done(batch, got)
    except OSError as e:
        raise os_error(e, f"reading at offset {offset} of", path) from e
    return total


_POOL = BouncePool(_BOUNCE_BYTES, _BOUNCE_KEEP)


def _aligned(offset: int, views: Sequence[memoryview]) -> bool:
    return offset % ALIGN == 0 and all(v.nbytes % ALIGN == 0 and address_of(v) % ALIGN == 0 for v in views)


def read_aligned(fd: int, path: str, offset: int, buffers: Sequence[Buffer]) -> int:
    """Fill ``buffers`` from ``offset`` with direct reads of aligned ranges (see the module
    docstring); returns the bytes read (the buffers' total size).

    Raises:
        IncompleteCheckpointError: the file ends before the buffers are full.
        CheckpointError: any other ``OSError`` (``EINVAL`` in its ``__cause__`` when refused).
    """
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    total = sum(v.nbytes for v in views)
    if not views:
        return 0
    if _aligned(offset, views):
        return read_full(fd, path, offset, views)
    end = offset + total
    bounce = _POOL.take()
    try:
        window = memoryview(bounce)
        pos = offset - offset % ALIGN  # file offset of window[0]
        vi, vpos = 0, 0  # next destination byte: views[vi][vpos], file offset `done`
        done = offset
        while done < end:
            want = min(len(window), -(-(end - pos) // ALIGN) * ALIGN)
            try:
                got = os.preadv(fd, [window[:want]], pos)
            except OSError as e:
                raise os_error(e, f"reading at offset {pos} of", path) from e
            have = pos + got  # file bytes [pos, have) are in the window
            if have <= done:
                raise truncated_error(path, offset, end, done)
            src = window[done - pos : min(have, end) - pos]
            while src.nbytes:
                dst = views[vi]
                n = min(dst.nbytes - vpos, src.nbytes)
                dst[vpos : vpos + n] = src[:n]
                src = src[n:]
                vpos += n
                done += n
                if vpos == dst.nbytes:
                    vi, vpos = vi + 1, 0
            if got < want and done < end:  # end of file inside the range
                raise truncated_error(path, offset, end, done)
            pos = have - have % ALIGN
    finally:
        _POOL.give(bounce)
    return total


class DirectSource:
    """One file read through a small pool of descriptors, each read sequentially.

    Args:
        path: the file (already checked by the store: inside the location, no links).
        level: the first read level tried, ``"unaligned"``, ``"aligned"`` or ``"buffered"``
            (module docstring). A refusal (``EINVAL`` from the open or a read) drops one level
            for this file: the pool's descriptors of the refused kind are closed and that read,
            and every later one, is made at the next level.

    Each concurrent reader of a file gets its own descriptor, preferably the one whose last read
    ended where this one starts, so every descriptor streams its file (the kernel reads ahead
    for buffered ones, and a FUSE object-store mount keeps one ranged request open instead of
    starting one per seek).
    """

    def __init__(self, path: str, level: str = "aligned") -> None:
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got {level!r}")
        self._path = path
        self._lock = threading.Lock()  # guards the pool and _level (reader threads share them)
        self._level = _LEVELS.index(level if _O_DIRECT else "buffered")
        fd, lvl = self._open()
        self._idle: list[tuple[int, int, bool]] = [(fd, 0, lvl < 2)]  # (fd, its last read's end, O_DIRECT)
        self._closed = False

    @property
    def level(self) -> str:
        """How new reads are made (see the module docstring)."""
        return _LEVELS[self._level]

    @property
    def direct(self) -> bool:
        """Whether new descriptors are opened with ``O_DIRECT``."""
        return self._level < 2

    def _open(self) -> tuple[int, int]:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            lvl = self._level
            if lvl < 2:
                try:
                    return os.open(self._path, flags | _O_DIRECT), lvl
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._level = 2  # no direct I/O on this filesystem
            return os.open(self._path, flags), 2
        except FileNotFoundError as e:
            raise missing_file_error(self._path) from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{self._path} is a symbolic link: goodput-ckpt never follows links inside a checkpoint location",
                    path=self._path,
                ) from e
            raise os_error(e, "opening", self._path) from e

    def _take(self, offset: int) -> tuple[int, bool]:
        with self._lock:
            if self._closed:
                raise CheckpointError(f"{self._path} was closed", path=self._path)
            for i, (_fd, end, _direct) in enumerate(self._idle):
                if end == offset:
                    fd, _, is_direct = self._idle.pop(i)
                    return fd, is_direct
            if self._idle:
                fd, _, is_direct = self._idle.pop()
                return fd, is_direct
        fd, lvl = self._open()
        return fd, lvl < 2

    def _give_back(self, fd: int, end: int, is_direct: bool) -> None:
        with self._lock:
            if not self._closed and (self._level < 2 or not is_direct):
                self._idle.append((fd, end, is_direct))
                return
        os.close(fd)

    def _refused(self, lvl: int) -> None:
        """A read at level ``lvl`` was refused: read at the next level from now on."""
        with self._lock:
            self._level = max(self._level, lvl + 1)
            if self._level < 2:
                return  # aligned reads keep the O_DIRECT descriptors
            stale = [fd for fd, _, is_direct in self._idle if is_direct]
            self._idle = [e for e in self._idle if not e[2]]
        for fd in stale:
            os.close(fd)

    def read_into(self, offset: int, buffers: Sequence[Buffer]) -> None:
        while True:
            fd, is_direct = self._take(offset)
            lvl = self._level if is_direct else 2
            if lvl == 2 and is_direct:  # refused meanwhile by another thread's read
                os.close(fd)
                continue
            try:
                if lvl == 1:
                    total = read_aligned(fd, self._path, offset, buffers)
                else:
                    total = read_full(fd, self._path, offset, buffers)
            except CheckpointError as e:
                os.close(fd)
                cause = e.__cause__
                if lvl < 2 and isinstance(cause, OSError) and cause.errno == errno.EINVAL:
                    self._refused(lvl)  # e.g. ext4: O_DIRECT opens, but wants aligned buffers
                    continue  # the whole range again, at the next level
                raise
            except BaseException:
                os.close(fd)
                raise
            break
        self._give_back(fd, offset + total, is_direct)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for fd, _, _ in idle:
            try:
                os.close(fd)
            except OSError:
                pass
