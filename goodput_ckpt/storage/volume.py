"""Mounted-volume store: object storage or a network filesystem mounted as a path.

Databricks ``/Volumes``, s3fs-fuse, gcsfuse, blobfuse, rclone mount, Mountpoint for S3, NFS and
SMB shares look like local directories but behave like object stores: a file can be written
once, in order, to its final name; seek, append and rewrite fail; rename is a copy or refused;
fsync may be an upload or a no-op; small files are expensive. This store asks for nothing else:

- Every file is created once (``O_TRUNC`` on a fresh name) and written strictly sequentially by
  one thread (``traits.random_writes`` False); the DCP writer then spreads a rank's bytes over
  several files (``thread_count`` of them), which are written in parallel. Each write call is
  one writer chunk (8 MiB by default), one ``writev`` of its pieces; a chunk made of many small
  pieces (small tensors, padding) is first joined into a reused buffer, so the mount sees large
  writes, not a scatter of small ones.
- No rename anywhere, the commit record included: the manifest is written last, in one write,
  straight to its final name (``O_EXCL`` unless replacing). A strict mount publishes it on
  close; a permissive one may show it half written, and a writer killed mid-write can leave a
  truncated one behind (a FUSE mount finishes the upload when the kernel releases the file).
  Hence ``traits.atomic_commit_record`` is False: readers treat a manifest that does not parse and
  validate as an incomplete checkpoint, never as a commit.
- Reads are ``preadv`` calls of a whole read task (16 MiB) into the destination, through
  descriptors opened with ``O_DIRECT`` where the filesystem takes it (``direct_reads``). A
  buffered read of a FUSE file goes daemon -> page cache -> destination, in readahead-sized
  requests (128 KiB on ``weed mount``); a direct one goes daemon -> destination in ``max_read``-
  sized requests (1 MiB there), without the page cache's copy and page bookkeeping. On two
  cores shared with the FUSE daemon and the server, that CPU is the load's bottleneck
  (docs/volumes.md). A filesystem that refuses an unaligned direct read (a local directory with
  ``volume=True``: ext4) is read with aligned direct reads, one that refuses ``O_DIRECT`` (older
  tmpfs) buffered (:mod:`.direct_read`, shared with the local store). With
  ``traits.sequential_reads`` the reader gives each of its threads a run of one file's tasks, in order;
  each concurrent reader of a file gets its own descriptor, preferably the one whose last read
  ended where this one starts, so every descriptor streams its file (the kernel reads ahead, and
  a FUSE object-store mount keeps one ranged request open instead of starting one per seek).
- fsync before close where the mount supports it (NFS: commit to the server; FUSE: flush),
  ignored where it does not. Directory fsyncs are skipped: volumes have no such durability step.

With ``stage_dir`` the writes go to local disk first and are uploaded in the background by
:class:`~goodput_ckpt.storage.staged.StagedStore`, which wraps this store.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckpointError
from .base import Buffer, StoreTraits, committed_elsewhere_error, drop_done, out_of_order_error
from .direct_read import DirectSource, os_error
from .local import LocalStore

__all__ = ["VolumeConfig", "VolumeStore"]

#: A chunk whose pieces average less than this is joined into one buffer before it is written;
#: larger pieces go out as one ``writev`` without a copy (the kernel hands a FUSE daemon the
#: same ``max_write``-sized requests either way; the copy would only cost CPU).
_JOIN_BELOW = 1 << 20
#: Linux caps an iovec array at IOV_MAX (1024).
_MAX_IOV = 512
#: fsync errors that mean "not supported by this filesystem" rather than "the data is lost".
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


@dataclass(frozen=True, kw_only=True)
class VolumeConfig:
    """Options of the mounted-volume backend (``CheckpointWriter(path, volume=True, ...)``).

    Attributes:
        fsync: fsync every file before closing it, where the mount supports fsync.
        stage_dir: a local directory to stage saves in. ``dcp.save`` then returns once the
            checkpoint is on local disk; its files are uploaded to the volume in the background
            and the manifest is written there once every rank's files are
            (``CheckpointWriter.durable_future()`` says when). ``None``: write to the volume
            directly.
        upload_threads: files uploaded at once per process (staging only; default 4).
        commit_timeout_s: how long the coordinator's background commit waits for the other
            ranks' uploads before it gives up (staging only; default 3600 s).
        direct_reads: read data files with ``O_DIRECT`` where the filesystem accepts it
            (bypassing the page cache: a checkpoint is read once, and on a FUSE mount a direct
            read moves the bytes from the daemon straight into the destination in large
            requests). Reads fall back to buffered ones on a filesystem that refuses it.
            ``False``: always buffered.
    """

    fsync: bool = True
    direct_reads: bool = True
    stage_dir: str | os.PathLike | None = None
    upload_threads: int | None = None
    commit_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fsync, bool):
            raise TypeError(f"fsync must be a bool, got {type(self.fsync).__name__}")
        if not isinstance(self.direct_reads, bool):
            raise TypeError(f"direct_reads must be a bool, got {type(self.direct_reads).__name__}")
        if self.stage_dir is None:
            staged_only = [n for n in ("upload_threads", "commit_timeout_s") if getattr(self, n) is not None]
            if staged_only:
                raise ValueError(f"{', '.join(staged_only)} only apply with stage_dir= (local staging)")
            return
        if not isinstance(self.stage_dir, (str, os.PathLike)) or not os.fspath(self.stage_dir):
            raise TypeError(f"stage_dir must be a non-empty path, got {self.stage_dir!r}")
        object.__setattr__(self, "stage_dir", os.path.abspath(os.fspath(self.stage_dir)))
        n = self.upload_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"upload_threads must be a positive integer, got {n!r}")
        t = self.commit_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"commit_timeout_s must be a positive number, got {t!r}")


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _FSYNC_UNSUPPORTED:
            raise os_error(e, "flushing", path) from e


def _close(fd: int, path: str) -> None:
    """Close ``fd``; on a FUSE or network mount this is where a failed upload is reported."""
    try:
        os.close(fd)
    except OSError as e:
        raise os_error(e, "finishing", path) from e


class _VolumeSink:
    """One file written once, in order, by one thread."""

    def __init__(self, path: str, fsync: bool) -> None:
        self._path = path
        self._fsync = fsync
        self._pos = 0
        self._bounce: bytearray | None = None  # joins a multi-piece chunk into one write
        self._state = "open"
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise os_error(e, "creating", path) from e

    def write_at(self, offset: int, buffers: Sequence[Buffer]) -> None:
        if self._state != "open":
            raise CheckpointError(f"{self._path} is {self._state}: no more writes", path=self._path)
        if offset != self._pos:
            raise out_of_order_error(self._path, self._pos, offset)
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        total = sum(v.nbytes for v in views)
        if len(views) > 1 and total < _JOIN_BELOW * len(views):
            # Many small pieces (small tensors, padding): one contiguous write instead.
            if self._bounce is None or len(self._bounce) < total:
                self._bounce = bytearray(total)
            data = memoryview(self._bounce)[:total]
            pos = 0
            for v in views:
                data[pos : pos + v.nbytes] = v
                pos += v.nbytes
            views = [data]
        try:
            while views:
                drop_done(views, os.writev(self._fd, views[:_MAX_IOV]))  # short writes go on
        except OSError as e:
            raise os_error(e, f"writing at offset {self._pos} of", self._path) from e
        self._pos += total

    def close(self) -> None:
        if self._state == "aborted":
            raise CheckpointError(f"{self._path} was aborted and cannot be completed", path=self._path)
        if self._state != "open":
            return
        self._state = "closed"
        self._bounce = None
        try:
            if self._fsync:
                _fsync(self._fd, self._path)
        except BaseException:
            try:
                os.close(self._fd)
            except OSError:
                pass
            raise
        _close(self._fd, self._path)

    def abort(self) -> None:
        if self._state == "aborted":
            return
        was_open = self._state == "open"
        self._state = "aborted"
        self._bounce = None
        if was_open:
            try:
                os.close(self._fd)  # a strict mount may now upload what was written: delete it
            except OSError:
                pass
        try:
            os.unlink(self._path)
        except OSError:
            pass


class VolumeStore(LocalStore):
    """A checkpoint directory on a mounted volume (see the module docstring).

    A :class:`LocalStore` in everything but writing, reading and committing: prepare, size,
    read_small, list and delete are plain POSIX calls that every volume supports.

    Args:
        root: the checkpoint directory.
        config: the backend's options.
        detected: why the path was found to be on a volume (for messages), ``None`` when
            volume mode was asked for explicitly.
    """

    def _traits(self) -> StoreTraits:
        # A reader can meet a partial manifest here (see the module docstring): one that fails
        # to parse means "incomplete", not "corrupt". The reader gives each thread a run of one
        # file's ranges, read in order. Files are written once: no appending.
        return StoreTraits(
            kind="volume", random_writes=False, atomic_commit_record=False, sequential_reads=True, local_path=self.root
        )

    def __init__(self, root: str, config: VolumeConfig | None = None, *, detected: str | None = None) -> None:
        super().__init__(root)
        self.config = config or VolumeConfig()
        self.detected = detected

    def __repr__(self) -> str:
        return f"VolumeStore({self.root!r})"

    def _sync_dir(self, directory: str) -> None:
        """Volumes have no directory fsync (FUSE refuses it, NFS creates synchronously)."""

    def open_sink(self, name: str, *, part_size: int | None = None) -> _VolumeSink:
        path = self._path(name)
        parent = os.path.dirname(path)
        if parent != self.root:
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise os_error(e, "creating directory", parent) from e
        return _VolumeSink(path, self.config.fsync)

    def open_source(self, name: str) -> DirectSource:
        return DirectSource(self._path(name), "unaligned" if self.config.direct_reads else "buffered")

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        """Write ``data`` to its final name in one write (no temporary file, no rename).

        The data files were fsynced and closed by their sinks before this is called. With
        ``replace`` an existing record is deleted first; without it the record is created with
        ``O_EXCL``, so two savers cannot both commit.
        """
        path = self._path(name)
        if replace:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise os_error(e, "replacing", path) from e
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError as e:
            raise committed_elsewhere_error(path) from e
        except OSError as e:
            raise os_error(e, "committing", path) from e
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as e:
                raise os_error(e, "committing", path) from e
            if self.config.fsync:
                _fsync(fd, path)
        except BaseException:
            for undo in (lambda: os.close(fd), lambda: os.unlink(path)):
                try:
                    undo()  # a partial record would read as incomplete; leave none
                except OSError:
                    pass
            raise
        try:
            _close(fd, path)
        except CheckpointError:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
