"""The local store's data-file sink: ``pwritev`` from many threads, or direct writes.

Kept apart from :mod:`.local` (the store: names, commit records, listing, deletion) because the
two ways a data file is written are one unit: buffered ``pwritev`` calls that start their own
writeback (``sync_file_range``), and, with ``LocalConfig.direct_writes``, writes around the page
cache through a second descriptor (:mod:`.direct_write`), falling back to the first for what
cannot go direct. Why each exists is in :mod:`.local`'s docstring and :mod:`.direct_write`'s.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence

from ..errors import CheckpointError
from .base import Buffer, drop_done
from .direct_read import os_error
from .direct_write import DirectWriter, open_direct

__all__ = ["LocalSink"]

# Linux caps an iovec array at IOV_MAX (1024); stay below it.
_MAX_IOV = 512


def _libc(name: str, argtypes: list, restype: type):
    """libc's ``name`` through ctypes (which releases the GIL for the call), for the Linux calls
    Python's ``os`` lacks; ``None`` elsewhere or where libc has no such function."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Python's ``os`` lacks it), or ``None``."""
    import ctypes

    return _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int)


#: Starts writeback of a just-written range (a hint: failures surface in the final fsync), so
#: the device write overlaps the copy and hashing instead of following them (measured with
#: benchmarks/sweep_local.py --writeback-ab: see docs/benchmarks.md).
_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _load_fallocate():
    """libc's ``fallocate`` (Python's ``os`` has only ``posix_fallocate``, which glibc emulates by
    writing every block where a filesystem lacks the call), or ``None``."""
    import ctypes

    return _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int)


#: Allocates a data file's blocks before its chunks are written (:meth:`LocalSink.reserve`).
_FALLOCATE = _load_fallocate()


def _iov_batches(buffers: Sequence[Buffer]):
    for i in range(0, len(buffers), _MAX_IOV):
        yield buffers[i : i + _MAX_IOV]


def _nbytes(buffers: Sequence[Buffer]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class LocalSink:
    """A data file written with pwritev from any number of threads.

    Buffered writes are copied into the page cache one at a time (a lock per file), while the
    other writer threads hash their next chunks: the kernel serializes buffered writes to one
    file on its inode lock anyway, and writers that wait there spin on the CPUs first. Measured
    with 4 threads writing 256 MiB of 8 MiB chunks to one ext4 file on 2 vCPUs (load 13): 0.136
    CPU-s unserialized, 0.063 serialized, 0.045 serialized with the file's blocks allocated up
    front (:meth:`reserve`), against about 0.07 for one thread's plain ``write`` of the same
    bytes (docs/benchmarks.md, "The physical limit").
    """

    def __init__(self, path: str, fsync: bool, direct: bool = False) -> None:
        self._path = path
        self._fsync = fsync
        self._closed = False
        self._aborted = False
        self._direct: DirectWriter | None = None
        self._copy_lock = threading.Lock()  # one buffered copy into the page cache at a time
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                self._fd = os.open(path, flags, 0o644)
            except FileExistsError:
                # A file of this name from an earlier attempt: replace it with a new inode rather
                # than truncate it (it may be a hard link to data elsewhere). unlink removes a
                # link itself, never its target.
                os.unlink(path)
                self._fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise os_error(e, "creating", path) from e
        dfd = open_direct(self._fd) if direct else None
        if dfd is not None:
            self._direct = DirectWriter(dfd, self.write_at)

    @property
    def direct(self) -> bool:
        """Whether this sink writes around the page cache (``LocalConfig.direct_writes``, on a
        filesystem that takes ``O_DIRECT``)."""
        return self._direct is not None and not self._direct.refused

    def reserve(self, size: int) -> None:
        """Allocate the file's ``size`` bytes of blocks before its chunks are written (a hint,
        called once by :func:`~..engine.hashed_write.write_hashed_files` right after the open).

        Why: chunks arrive from several threads, out of order, each beyond the end the file has
        so far, and such an extending write allocates blocks and moves the size under the inode's
        lock; once the blocks exist and the file has its final size, the writes only fill them.
        Measured on ext4 (class docstring): buffered writes' CPU 0.063 -> 0.045 CPU-s per 256 MiB;
        direct writes unchanged (the device is their limit). A filesystem without ``fallocate``
        (or any failure, a full disk included) leaves the file as it is: the writes then
        allocate as before, and a full disk fails them with the same error as without this.
        """
        if _FALLOCATE is None or size <= 0 or self._closed:
            return
        _FALLOCATE(self._fd, 0, 0, size)  # mode 0: allocate and set the size; -1 on failure: ignored

    def write_hashed(self, offset: int, buffers: Sequence[Buffer], hasher) -> None:
        """Hash ``buffers`` and write them at ``offset``: directly where this sink writes around
        the page cache and the chunk allows it (:mod:`.direct_write`), else buffered."""
        if self._closed:
            raise CheckpointError(f"{self._path} is closed or aborted: no more writes", path=self._path)
        if self._direct is not None:
            try:
                if self._direct.write_hashed(offset, buffers, hasher):
                    return
            except OSError as e:
                raise os_error(e, f"writing at offset {offset} of", self._path) from e
        for b in buffers:
            hasher.update(b)
        self.write_at(offset, buffers)

    def _close_direct(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    def write_at(self, offset: int, buffers: Sequence[Buffer]) -> None:
        if self._closed:  # its descriptor is closed, and its number may already be another file's
            raise CheckpointError(f"{self._path} is closed or aborted: no more writes", path=self._path)
        start = offset
        try:
            with self._copy_lock:  # see the class docstring
                for batch in _iov_batches(buffers):
                    views = [memoryview(b).cast("B") for b in batch]
                    while views:
                        written = os.pwritev(self._fd, views, offset)
                        offset += written
                        drop_done(views, written)  # rare: a short write; retry the rest
        except OSError as e:
            raise os_error(e, f"writing at offset {offset} of", self._path) from e
        if self._fsync and _SYNC_FILE_RANGE is not None and offset > start:
            _SYNC_FILE_RANGE(self._fd, start, offset - start, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> None:
        if self._aborted:
            raise CheckpointError(f"{self._path} was aborted and cannot be completed", path=self._path)
        if self._closed:
            return
        self._close_direct()  # its writes are on the device; the fsync below covers the inode
        try:
            if self._fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise os_error(e, "flushing", self._path) from e
        finally:
            self._closed = True
            os.close(self._fd)

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._close_direct()
        if not self._closed:
            self._closed = True
            os.close(self._fd)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
