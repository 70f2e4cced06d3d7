"""Checks on what a foreign checkpoint claims, made before anything is planned or allocated."""

from __future__ import annotations

from ...errors import CorruptCheckpointError
from ...storage import Store
from .base import Source

__all__ = ["check_planner_data", "read_small_capped"]


def check_planner_data(source: Source) -> None:
    """Refuse a ``planner_data`` whose paths would make rebuilding the nested state dict
    allocate without bound.

    Why: a path part that is an integer is a list index, and rebuilding (torch's
    ``unflatten_state_dict``, in the torch writer and in a stock ``dcp.load``) grows the list
    to that index. A list holds at most one entry per item, so an index of at least the number
    of items is a claim no stored value backs: a small file could otherwise ask for 2^40 slots.

    Raises:
        CorruptCheckpointError: a path that is not a list of strings and non-negative integers,
            or an index past the number of items (named by key).
    """
    pd = source.planner_data
    if pd is None:
        return
    n = len(source.items)
    for key, path in pd.items():
        ok = isinstance(path, (list, tuple)) and all(
            isinstance(p, str) or (type(p) is int and 0 <= p < max(n, 1)) for p in path
        )
        if not ok:
            raise CorruptCheckpointError(
                f"{source.uri}: planner_data for {key!r} is {str(path)[:200]}; a path is a list of names and list "
                f"indexes below the number of items ({n})",
                key=key,
            )


def read_small_capped(store: Store, name: str, limit: int, what: str) -> bytes | None:
    """The whole of a small file (a commit record, a header, an index, a sidecar), or ``None``
    when it is missing; never more than ``limit`` bytes.

    Why: a foreign checkpoint's small files are read whole and parsed in memory. Without a cap,
    a 3 GiB sparse file or an endless one exhausts memory before any parser can refuse it.
    The size is asked first (the stores refuse links and non-regular files there), and then
    exactly that many bytes are read by range, so a file that grows meanwhile is not read past
    the size that was checked. Every foreign small file goes through here, so this is the one
    place to swap for a store's own capped read.

    Raises:
        CorruptCheckpointError: the file is larger than ``limit``.
        CheckpointError: the store refuses the file (a link, not a regular file).
    """
    size = store.size(name)
    if size is None:
        return None
    where = f"{store.uri.rstrip('/')}/{name}"
    if size > limit:
        raise CorruptCheckpointError(
            f"{what} {where} is {size} bytes, over the {limit}-byte limit for it; refusing to read it",
            path=where,
        )
    buf = bytearray(size)
    if size:
        src = store.open_source(name)
        try:
            src.read_into(0, [memoryview(buf)])
        finally:
            src.close()
    return bytes(buf)
