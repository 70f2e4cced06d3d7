"""Whether two locations are the same place, or one lies inside the other.

Tools that write a new checkpoint from an old one (``reshard``, ``convert``) must never write
into their source: with ``overwrite`` that would delete it. Comparing the paths as strings misses
every alias of a directory (a symbolic link to it, a bind mount, ``a/../a``), so local paths are
compared by what they are on disk: each is resolved to its real path, and the device and inode
of every existing directory on the way are compared too, which also catches bind mounts and hard
links that no path comparison can see. Remote URIs have no aliases of that kind; they are
compared as normalised prefixes.
"""

from __future__ import annotations

import os
import posixpath

__all__ = ["locations_overlap"]


def _chain(path: str) -> list[tuple[int, int]]:
    """``(st_dev, st_ino)`` of ``path`` (when it exists) and of every existing ancestor."""
    out: list[tuple[int, int]] = []
    current = path
    while True:
        try:
            st = os.stat(current)
            out.append((st.st_dev, st.st_ino))
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return out
        current = parent


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _inside(a: str, b: str) -> bool:
    """Whether the real path ``a`` is ``b`` or below it."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def local_paths_overlap(a: str, b: str) -> bool:
    """Whether the local paths ``a`` and ``b`` are one place, or one contains the other."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if _inside(ra, rb) or _inside(rb, ra):
        return True
    ia, ib = _identity(ra), _identity(rb)
    return (ia is not None and ia in _chain(rb)) or (ib is not None and ib in _chain(ra))


def _remote_key(uri: str) -> str:
    scheme, sep, rest = uri.partition("://")
    rest = posixpath.normpath("/" + rest.strip("/")).lstrip("/") if rest.strip("/") else ""
    return f"{scheme.lower()}{sep}{rest}"


def locations_overlap(a: str | os.PathLike, b: str | os.PathLike, *, local: tuple[str | None, str | None]) -> bool:
    """Whether locations ``a`` and ``b`` are the same place or nested, for any two URIs.

    Args:
        a, b: the two URIs (as the user gave them, or a store's ``uri``).
        local: each one's local filesystem path, or ``None`` where it is not local.
    """
    la, lb = local
    if la is not None and lb is not None:
        return local_paths_overlap(la, lb)
    if (la is None) != (lb is None):
        return False
    ka, kb = _remote_key(os.fspath(a)), _remote_key(os.fspath(b))
    return ka == kb or ka.startswith(kb.rstrip("/") + "/") or kb.startswith(ka.rstrip("/") + "/")
