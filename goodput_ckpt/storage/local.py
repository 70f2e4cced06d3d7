"""Local-disk store: data files written direct or with parallel ``pwritev``, durable commit by fsync + link/rename.

Why these choices:
- A save that runs beside training writes its data files around the page cache (``direct_writes``,
  :mod:`.direct_write`): less CPU taken from training. One the caller waits for writes them with
  buffered ``pwritev`` calls (:mod:`.local_sink`), where the page cache absorbs them faster, unless
  the CPUs are contended or memory is being reclaimed (:mod:`.write_mode`): then direct is faster.
- Reads are buffered by default (the kernel's readahead measured faster than direct reads on
  the development machine); ``direct_reads=True`` bypasses the page cache (:mod:`.direct_read`).
- ``os.pwritev``/``os.preadv`` take lists of buffers at an offset, so the writer can hand the
  raw bytes of several tensors (plus alignment padding) to the kernel without first joining them,
  and the reader can scatter one read straight into several destination tensors. Both release
  the GIL and are safe from many threads on one descriptor.
- Each written part starts its own writeback at once (``sync_file_range``), so the disk works
  while later parts are still being hashed and copied; the final fsync then only waits for the
  tail. Without it the kernel holds everything dirty until the fsync (below its dirty threshold,
  10% of RAM, nothing is written back early) and a save costs copy time *plus* disk time.
- The commit record is written to a temporary name, fsynced, then published with ``os.link``
  (which fails if the target exists, so two savers cannot both commit) or ``os.replace`` when
  replacing is allowed, and the directory is fsynced. A crash at any instant leaves either no
  manifest or the whole one.
- Nothing outside the location is ever touched. The root is resolved to its real path once;
  below it, no symbolic link is followed: a directory component that is a link is refused
  before any read, write or delete, the last component is opened with ``O_NOFOLLOW``, and a
  data file is created afresh (``O_EXCL``), never truncated in place, so a hard link to a file
  elsewhere cannot be overwritten through the location. ``list`` leaves out links and anything
  that is not a regular file, so no clean-up ever reaches them.
"""

from __future__ import annotations

import copy
import errno
import os
import secrets
import stat
from dataclasses import dataclass, replace

from ..errors import CheckpointError
from .base import (
    SMALL_FILE_LIMIT,
    StoreTraits,
    check_relative_name,
    committed_elsewhere_error,
    read_capped,
    too_large_error,
)
from .direct_read import DirectSource, os_error
from .local_sink import LocalSink
from .write_mode import should_write_direct

__all__ = ["LocalConfig", "LocalStore"]


@dataclass(frozen=True, kw_only=True)
class LocalConfig:
    """Options of the local-disk backend.

    Attributes:
        fsync: fsync data files, the manifest and the directory before the commit. Turning it
            off trades crash safety for speed (only for scratch data on tmpfs, benchmarks).
        direct_reads: read data files with ``O_DIRECT`` (aligned, through reused bounce buffers
            where the destination is not aligned; :mod:`.direct_read`): no page-cache copy and
            bookkeeping on the cores that hash the bytes (a verified load took 0.42 CPU-s per
            1.6 GB without hashing, against about 0.5 buffered). Off by default: on the
            development machine's virtual disk, whose 8 MiB kernel readahead keeps more in
            flight, direct reads delivered 0.68x the throughput of buffered ones
            (docs/benchmarks.md, "Local disk"). Turn it on where the device serves direct reads
            at full speed (NVMe), or to keep a load from evicting the page cache. A filesystem
            that refuses ``O_DIRECT`` is read buffered.
        direct_writes: write data files with ``O_DIRECT`` from reused, page-aligned bounce
            buffers (:mod:`.direct_write`): no page-cache copy and no page allocation per byte.
            ``None`` (the default): direct for a save that runs beside training
            (``dcp.async_save`` staging through ``CheckpointWriter``, the manager's async
            saves); for one the caller waits for, chosen when each data file is opened from the
            machine's state (:mod:`.write_mode`): buffered while the CPUs have room, direct when
            runnable tasks wait for them or memory is being reclaimed. Measured on the
            development machine (docs/benchmarks.md): beside a training loop a direct 48 MiB
            save cost 5-30 CPU-ms against 70-120 buffered, and the loop's goodput went from
            0.85x to 1.14x torch's writer; a save on its own reached 0.96x a raw write buffered
            against 0.74x direct on a quiet machine, and 0.48x buffered against 1.39x direct
            under CPU load (256 MiB). ``True`` or ``False`` fixes the choice for every save.
            The cost of direct writes: the checkpoint is not left in the page cache, so a load
            right after a save reads the device. A filesystem that refuses ``O_DIRECT`` (ramfs:
            at open; a device whose sectors are larger than 4 KiB: at the first write) is
            written buffered, as is a chunk at an unaligned offset, and so is everything with
            ``fsync=False`` (scratch data, a volume save's local staging, whose upload reads the
            files back at once).
    """

    fsync: bool = True
    direct_reads: bool = False
    direct_writes: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fsync, bool):
            raise TypeError(f"fsync must be a bool, got {type(self.fsync).__name__}")
        if self.direct_writes is not None and not isinstance(self.direct_writes, bool):
            raise TypeError(f"direct_writes must be a bool or None, got {type(self.direct_writes).__name__}")
        if not isinstance(self.direct_reads, bool):
            raise TypeError(f"direct_reads must be a bool, got {type(self.direct_reads).__name__}")


class LocalStore:
    """A checkpoint directory on a local (POSIX) filesystem."""

    def __init__(self, root: str, config: LocalConfig | None = None) -> None:
        #: The location's real path: every file operation stays below it.
        self.root = os.path.realpath(root)
        #: The path as given (made absolute), for messages.
        self.uri = os.path.abspath(root)
        self.config = config or LocalConfig()
        self.traits = self._traits()

    def _traits(self) -> StoreTraits:
        return StoreTraits(kind="local", random_writes=True, can_append=True, local_path=self.root)

    # -- helpers ---------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        """The path of ``name`` below the root, after proving that no directory on the way is a
        symbolic link (the last component is opened with ``O_NOFOLLOW`` or checked by the caller).

        Raises:
            CheckpointError: ``name`` is not a safe relative name, or a directory on its way is a
                link or not a directory.
        """
        parts = check_relative_name(name).split("/")
        path = self.root
        for part in parts[:-1]:
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break  # nothing below exists yet: nothing to follow
            except OSError as e:
                raise os_error(e, "inspecting", path) from e
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointError(
                    f"{path} is a symbolic link: goodput-ckpt never follows links inside a "
                    f"checkpoint location ({self.root}), so {name!r} is refused",
                    path=path,
                )
            if not stat.S_ISDIR(st.st_mode):
                raise CheckpointError(f"{path} is not a directory, so {name!r} cannot be below it", path=path)
        return os.path.join(self.root, *parts)

    def _regular(self, name: str) -> tuple[str, os.stat_result | None]:
        """``name``'s path and ``lstat`` (``None``: missing), refusing a link or a non-regular file."""
        path = self._path(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path, None
        except OSError as e:
            raise os_error(e, "inspecting", path) from e
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointError(
                f"{path} is {what}: checkpoint files are regular files inside the location, "
                "and goodput-ckpt never follows links",
                path=path,
            )
        return path, st

    def _sync_dir(self, directory: str) -> None:
        if not self.config.fsync:
            return
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- Store -----------------------------------------------------------------------------
    def prepare(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint location {self.uri} exists and is not a directory", path=self.uri)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise os_error(e, "creating directory", self.root) from e
        if os.path.realpath(self.root) != self.root:
            # Made into a link after this store resolved it: its files would land elsewhere.
            raise CheckpointError(
                f"checkpoint location {self.uri} changed into a symbolic link while in use", path=self.uri
            )

    def open_sink(self, name: str, *, part_size: int | None = None) -> LocalSink:
        path = self._path(name)
        parent = os.path.dirname(path)
        if parent != self.root:
            os.makedirs(parent, exist_ok=True)
        # Without fsync (scratch data, a volume save's local staging, whose upload reads the files
        # back at once) the page cache is where the bytes are wanted: write buffered.
        if not self.config.fsync:
            direct = False
        elif self.config.direct_writes is None:
            direct = should_write_direct()[0]  # a save the caller waits for: by the machine's state
        else:
            direct = self.config.direct_writes
        return LocalSink(path, self.config.fsync, direct)

    def for_background_save(self) -> LocalStore:
        """This store for a save that runs beside training: with ``direct_writes=None`` (auto)
        one that writes its data files direct, else this store as it is."""
        if not isinstance(self.config, LocalConfig) or self.config.direct_writes is not None:
            return self  # a subclass with a configuration of its own (a volume) writes its own way
        clone = copy.copy(self)
        clone.config = replace(self.config, direct_writes=True)
        return clone

    def open_source(self, name: str) -> DirectSource:
        return DirectSource(self._path(name), "aligned" if self.config.direct_reads else "buffered")

    def size(self, name: str) -> int | None:
        _path, st = self._regular(name)
        return None if st is None else st.st_size

    def read_small(self, name: str, *, max_bytes: int = SMALL_FILE_LIMIT) -> bytes | None:
        path = self._path(name)
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait for a writer (it is refused below).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{path} is a symbolic link: goodput-ckpt never follows links inside a checkpoint location",
                    path=path,
                ) from e
            raise os_error(e, "reading", path) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path} is not a regular file, expected a file", path=path)
            if st.st_size > max_bytes:
                raise too_large_error(path, st.st_size, max_bytes)
            with open(fd, "rb", closefd=False) as f:
                data = read_capped(f.read, path, max_bytes, expected=st.st_size)  # it may have grown
            return data
        except OSError as e:
            raise os_error(e, "reading", path) from e
        finally:
            os.close(fd)

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        path = self._path(name)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}")
        try:
            # Data files were fsynced by their sinks; make their directory entries durable too,
            # before the record that points at them can exist.
            self._sync_dir(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if replace:
                os.replace(tmp, path)
            else:
                self._link_exclusive(tmp, path)
            self._sync_dir(directory)
        except CheckpointError:
            raise
        except OSError as e:
            raise os_error(e, "committing", path) from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _link_exclusive(self, tmp: str, path: str) -> None:
        try:
            os.link(tmp, path)
        except FileExistsError as e:
            raise committed_elsewhere_error(path) from e
        except FileNotFoundError as e:
            # A writer that committed first removes every other temporary record (its cleanup
            # of stale files), ours included: the location is taken.
            if os.path.exists(path):
                raise committed_elsewhere_error(path) from e
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # Filesystems without hard links: check, then rename (a narrow race remains).
            if os.path.exists(path):
                raise committed_elsewhere_error(path) from e
            os.rename(tmp, path)

    def list(self) -> list[str]:
        out: list[str] = []
        if not os.path.isdir(self.root):
            return out
        # os.walk does not descend into linked directories; linked and special files are left
        # out here, so that no clean-up that works from the listing can ever reach them.
        for dirpath, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                try:
                    if not stat.S_ISREG(os.lstat(os.path.join(dirpath, f)).st_mode):
                        continue
                except FileNotFoundError:
                    continue
                out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
        return sorted(out)

    def delete(self, name: str) -> None:
        path, st = self._regular(name)  # never a link (nor anything through one)
        if st is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise os_error(e, "deleting", path) from e
        self._sync_dir(os.path.dirname(path))
        # Like an object store, a directory inside the location exists only while it holds
        # files: remove the ones this deletion emptied (a manager root's step directories).
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root + os.sep):
            try:
                os.rmdir(parent)
            except OSError:  # not empty (or already gone): stop here
                break
            parent = os.path.dirname(parent)
