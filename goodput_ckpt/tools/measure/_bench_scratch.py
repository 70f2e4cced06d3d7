"""Where ``bench`` writes: one fresh directory or key prefix, and everything under it removed.

A local location (the default) is a new ``goodput-bench-*`` directory under the given path (the
current directory when none is given: that is where checkpoints usually go, while the temp
dir may be a RAM disk). A remote one (``s3://bucket/prefix``, another fsspec URL) is a new
``goodput-bench-*`` prefix under it. Every checkpoint of the run is a child of that root, so
clean-up is one removal whatever failed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlparse

from ...storage import open_store

__all__ = ["Scratch", "evict_page_cache"]


def evict_page_cache(path: str) -> bool:
    """Drop the cached pages of every file under ``path``, so the next read comes from storage.

    ``posix_fadvise(DONTNEED)`` on each file, after an fsync (only clean pages can be dropped).
    Unlike ``echo 3 > /proc/sys/vm/drop_caches`` it needs no root and leaves the rest of the
    machine's cache alone. Returns False where the platform has no ``posix_fadvise``.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


class Scratch:
    """The root every checkpoint of one bench run lives under.

    Args:
        uri: a directory (created when missing), ``file://`` URL, a path on a mounted volume, or
            a remote URL; ``None``: the current directory.
        options: backend options (as for :func:`~goodput_ckpt.storage.open_store`).

    Raises:
        TypeError, ValueError: unknown or bad backend options, an unsupported URI.
    """

    def __init__(self, uri: str | os.PathLike | None, options: Mapping[str, Any]) -> None:
        text = os.getcwd() if uri is None else os.fspath(uri)
        self.options = dict(options)
        self._created: tuple[str, str] | None = None  # (base, highest created) of a new base
        if text.startswith("file://"):
            text = unquote(urlparse(text).path)
        if "://" in text:
            self.path: str | None = None
            self.root = f"{text.rstrip('/')}/goodput-bench-{secrets.token_hex(4)}"
        else:
            base = os.path.abspath(text)
            if not os.path.exists(base):
                top = base  # the highest directory this run creates
                while not os.path.exists(os.path.dirname(top)):
                    top = os.path.dirname(top)
                os.makedirs(base)
                self._created = (base, top)
            self.path = tempfile.mkdtemp(prefix="goodput-bench-", dir=base)
            self.root = self.path
        try:
            self.backend = open_store(self.root, self.options).traits.kind
        except BaseException:
            self.cleanup()
            raise

    def uri(self, name: str) -> str:
        """The location of the checkpoint ``name`` (a path for local roots)."""
        return os.path.join(self.path, name) if self.path is not None else f"{self.root}/{name}"

    def check_room(self, size: int, checkpoints: int) -> None:
        """Refuse to start when ``checkpoints`` of a ``size``-byte state cannot fit (local roots).

        Raises:
            ValueError: not enough free space.
        """
        if self.path is None:
            return  # remote: unknown, and usually not the limit
        free = shutil.disk_usage(self.path).free
        need = int(size * 1.05 + (64 << 20)) * checkpoints
        if free < need:
            raise ValueError(
                f"only {free / 1e9:.2f} GB free under {self.path}: {checkpoints} checkpoint(s) of a "
                f"{size / 1e9:.2f} GB state need about {need / 1e9:.2f} GB; choose a smaller size or "
                "another location"
            )

    def stored(self, name: str) -> tuple[int, int]:
        """(files, bytes) the checkpoint ``name`` occupies."""
        store = open_store(self.uri(name), self.options)
        names = store.list()
        return len(names), sum(store.size(n) or 0 for n in names)

    def evict(self, name: str) -> bool | None:
        """Make the next read of ``name`` come from storage: True when done, False when the
        platform cannot, ``None`` for remote roots (their caches are the server's)."""
        return evict_page_cache(self.uri(name)) if self.path is not None else None

    def remove(self, name: str) -> None:
        """Delete the checkpoint ``name`` (every file under it, whoever wrote it)."""
        if self.path is not None:
            shutil.rmtree(self.uri(name), ignore_errors=True)
            return
        store = open_store(self.uri(name), self.options)
        for n in store.list():
            store.delete(n)

    def cleanup(self) -> None:
        """Delete the root and everything under it, and the directories this run created."""
        if self.path is None:
            store = open_store(self.root, self.options)
            for n in store.list():
                store.delete(n)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self._created is not None:
            d, top = self._created
            while True:
                try:
                    os.rmdir(d)  # only when empty: never someone else's files
                except OSError:
                    return
                if d == top:
                    return
                d = os.path.dirname(d)
