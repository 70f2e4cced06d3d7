"""Generic fsspec store: any URL whose protocol fsspec has installed (``gs://``, ``az://``,
``memory://`` ...). ``s3://`` goes to the dedicated S3 store and local paths to the local store.

Why these choices:
- Most fsspec backends write a file as one sequential stream (``open(path, "wb")``), so this
  store has ``traits.random_writes`` False: the writer gives each file one thread and writes it in
  order, and spreads a rank's bytes over several files to keep its threads busy.
- A ranged read is ``cat_file(path, start, end)``, which remote backends turn into one ranged
  request; the bytes are then copied into the destination buffers (fsspec has no read-into).
- The commit record is ``pipe_file``: one whole-object PUT on object stores, where it is atomic.
  Without ``replace`` it is check-then-put: fsspec has no portable conditional write, so two
  savers that pass the check at the same moment both write and the later one wins. On
  filesystem-like backends (sftp, ftp, hdfs ...) ``pipe_file`` writes the record in place under
  its final name, not atomically: there ``traits.atomic_commit_record`` is False, so readers and tools
  call a record that does not validate incomplete, as on a mounted volume (storage.base). Only
  the object stores of :data:`ATOMIC_PUT_PROTOCOLS` (and ``memory://``) count as atomic.
- Credentials in the URL (``http://user:password@host/...``) reach fsspec, never ``uri``, a repr
  or a message (:func:`~.base.redact`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from .base import (
    SMALL_FILE_LIMIT,
    StoreTraits,
    byte_views,
    check_relative_name,
    committed_elsewhere_error,
    missing_file_error,
    out_of_order_error,
    redact,
    too_large_error,
    truncated_error,
)

__all__ = ["ATOMIC_PUT_PROTOCOLS", "FsspecConfig", "FsspecStore", "fsspec_protocol", "require_driver"]

#: Protocols whose ``pipe_file`` is one whole-object PUT (or, for ``memory``, one assignment):
#: readers see the commit record whole or not at all.
ATOMIC_PUT_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "tos", "memory"}
)


@dataclass(frozen=True, kw_only=True)
class FsspecConfig:
    """Options of the generic fsspec backend.

    Attributes:
        storage_options: keyword arguments for the fsspec filesystem of the URL's protocol
            (``fsspec.filesystem(protocol, **storage_options)``), e.g. a project or an account.
        filesystem: a ready fsspec filesystem to use instead (then ``storage_options`` must be
            empty). Pickled with the writer only if the filesystem itself pickles.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    filesystem: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            raise TypeError("storage_options must be a mapping with string keys")
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.filesystem is not None:
            if self.storage_options:
                raise ValueError("pass either filesystem or storage_options, not both")
            if not callable(getattr(self.filesystem, "cat_file", None)):
                raise TypeError(f"filesystem must be an fsspec filesystem, got {type(self.filesystem).__name__}")


def fsspec_protocol(uri: str) -> str | None:
    """The protocol of ``uri`` when fsspec knows it (installed or not), else ``None``."""
    proto, sep, _ = uri.partition("://")
    if not sep or not proto:
        return None
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        return None
    return proto if proto in fsspec.available_protocols() else None


def require_driver(protocol: str, where: str) -> None:
    """Refuse a protocol whose fsspec implementation cannot be imported, before any work.

    Why: fsspec lists protocols whose packages are not installed (``gs`` needs ``gcsfs``).
    Found only at the first read, the missing package looked like a failed check (exit 1); it
    is the environment, said up front as a usage-level error (exit 2) naming the package.

    Raises:
        ValueError: the implementation's package is missing.
    """
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        from fsspec.registry import known_implementations

        hint = known_implementations.get(protocol, {}).get("err") or str(e)
        raise ValueError(f"{where}: fsspec needs a package that is not installed for {protocol}:// ({hint})") from None


def _fs_error(exc: Exception, what: str, where: str) -> CheckpointError:
    # fsspec's messages may quote the full URL, credentials included.
    return CheckpointError(f"{what} {where} failed: {type(exc).__name__}: {redact(str(exc)[:300])}", path=where)


class _FsspecSink:
    """One file written as a sequential stream (``traits.random_writes`` False)."""

    def __init__(self, fs: Any, path: str, where: str) -> None:
        self._path = path
        self._where = where
        self._pos = 0
        self._state = "open"
        try:
            self._file = fs.open(path, "wb")
        except Exception as e:
            raise _fs_error(e, "creating", where) from e
        self._fs = fs

    def write_at(self, offset: int, buffers: Sequence[Any]) -> None:
        if self._state != "open":
            raise CheckpointError(f"{self._where} is {self._state}: no more writes", path=self._where)
        if offset != self._pos:
            raise out_of_order_error(self._where, self._pos, offset)
        try:
            for b in buffers:
                self._pos += self._file.write(memoryview(b).cast("B")) or 0
        except Exception as e:
            raise _fs_error(e, f"writing at offset {offset} of", self._where) from e

    def close(self) -> None:
        if self._state == "aborted":
            raise CheckpointError(f"{self._where} was aborted and cannot be completed", path=self._where)
        if self._state == "closed":
            return
        try:
            self._file.close()  # uploads what is buffered and commits the object
        except Exception as e:
            raise _fs_error(e, "finishing", self._where) from e
        self._state = "closed"

    def abort(self) -> None:
        if self._state == "aborted":
            return
        was_open = self._state == "open"
        self._state = "aborted"
        if was_open and callable(getattr(self._file, "discard", None)):
            try:
                self._file.discard()  # drop a pending upload without committing it
            except Exception:  # noqa: BLE001 - best effort: the original error matters more
                pass
        try:
            self._fs.rm_file(self._path)
        except Exception:  # noqa: BLE001 - usually "not found": nothing was committed
            pass


class _FsspecSource:
    def __init__(self, fs: Any, path: str, where: str) -> None:
        self._fs = fs
        self._path = path
        self._where = where

    def read_into(self, offset: int, buffers: Sequence[Any]) -> None:
        views = byte_views(buffers)
        total = sum(v.nbytes for v in views)
        if not total:
            return
        try:
            data = self._fs.cat_file(self._path, start=offset, end=offset + total)
        except FileNotFoundError as e:
            raise missing_file_error(self._where) from e
        except Exception as e:
            raise _fs_error(e, f"reading bytes [{offset}, {offset + total}) of", self._where) from e
        if len(data) < total:
            raise truncated_error(self._where, offset, offset + total, offset + len(data))
        pos = 0
        for v in views:
            v[:] = data[pos : pos + v.nbytes]
            pos += v.nbytes

    def close(self) -> None:
        """Nothing to release: every read is one request."""


class FsspecStore:
    """A checkpoint location on any fsspec filesystem."""

    def __init__(self, uri: str, config: FsspecConfig | None = None) -> None:
        protocol = fsspec_protocol(uri)
        if protocol is None:
            raise ValueError(f"fsspec does not know the protocol of {redact(uri)!r}")
        self.protocol = protocol
        self._url = uri.rstrip("/")  # what fsspec gets: it may hold credentials
        self.uri = redact(self._url)
        self.config = config or FsspecConfig()
        # One sequential stream per file; each request costs (ranks share one manifest read,
        # dcp/manifest_share.py); the record is atomic only where pipe_file is one PUT.
        self.traits = StoreTraits(
            kind="fsspec",
            random_writes=False,
            atomic_commit_record=protocol in ATOMIC_PUT_PROTOCOLS,
            costly_requests=True,
        )
        self._init_runtime()

    def __repr__(self) -> str:
        return f"FsspecStore({self.uri!r})"

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()  # guards creating the filesystem
        self._fs: Any = self.config.filesystem
        self._root: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_fs", "_root"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _filesystem(self) -> tuple[Any, str]:
        with self._lock:
            if self._root is None:
                try:
                    import fsspec

                    cls = fsspec.get_filesystem_class(self.protocol)
                    if self._fs is None:
                        # What the URL itself says (host, port, user, password), then the options.
                        kwargs = {**cls._get_kwargs_from_urls(self._url), **self.config.storage_options}
                        self._fs = fsspec.filesystem(self.protocol, **kwargs)
                    fs = self._fs
                except ImportError as e:
                    raise CheckpointError(
                        f"fsspec needs an extra package for {self.protocol}:// ({e}); install it to use {self.uri}",
                        path=self.uri,
                    ) from e
                except Exception as e:  # noqa: BLE001 - a filesystem that cannot be made (a connection, an argument)
                    raise _fs_error(e, "opening the filesystem of", self.uri) from e
                self._fs = fs
                self._root = cls._strip_protocol(self._url).rstrip("/")
            return self._fs, self._root

    def _path(self, name: str) -> tuple[Any, str, str]:
        fs, root = self._filesystem()
        name = check_relative_name(name)
        return fs, f"{root}/{name}", f"{self.uri}/{name}"

    # -- Store -------------------------------------------------------------------------------
    def prepare(self) -> None:
        fs, root = self._filesystem()
        try:
            fs.makedirs(root, exist_ok=True)
        except Exception as e:
            raise _fs_error(e, "creating", self.uri) from e

    def open_sink(self, name: str, *, part_size: int | None = None) -> _FsspecSink:
        fs, path, where = self._path(name)
        parent = path.rsplit("/", 1)[0]
        if name.count("/"):
            fs.makedirs(parent, exist_ok=True)
        return _FsspecSink(fs, path, where)

    def open_source(self, name: str) -> _FsspecSource:
        fs, path, where = self._path(name)
        return _FsspecSource(fs, path, where)

    def size(self, name: str) -> int | None:
        fs, path, where = self._path(name)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _fs_error(e, "inspecting", where) from e
        return None if info.get("type") == "directory" else int(info["size"])

    def read_small(self, name: str, *, max_bytes: int = SMALL_FILE_LIMIT) -> bytes | None:
        size = self.size(name)  # first: a huge file is refused without a read
        if size is not None and size > max_bytes:
            raise too_large_error(f"{self.uri}/{name}", size, max_bytes)
        fs, path, where = self._path(name)
        try:
            data = bytes(fs.cat_file(path, start=0, end=max_bytes + 1))  # bounded all the same
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _fs_error(e, "reading", where) from e
        if len(data) > max_bytes:
            raise too_large_error(where, None, max_bytes)
        return data

    def put_commit_record(self, name: str, data: bytes, *, replace: bool) -> None:
        fs, path, where = self._path(name)
        if not replace and self.size(name) is not None:
            raise committed_elsewhere_error(where)
        try:
            fs.pipe_file(path, bytes(data))
        except Exception as e:
            raise _fs_error(e, "committing", where) from e

    def list(self) -> list[str]:
        fs, root = self._filesystem()
        try:
            found = fs.find(root)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise _fs_error(e, "listing", self.uri) from e
        base = root + "/"
        return sorted(p[len(base) :] for p in found if p.startswith(base))

    def delete(self, name: str) -> None:
        fs, path, where = self._path(name)
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            return
        except Exception as e:
            raise _fs_error(e, "deleting", where) from e
