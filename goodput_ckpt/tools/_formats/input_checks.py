"""Checks on what a foreign checkpoint claims, made before anything is planned or allocated."""

from __future__ import annotations

from ...errors import CorruptCheckpointError, FileTooLargeError
from ...format.nesting import int_keys_problem
from ...format.parse import planner_path_problem
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
    why = int_keys_problem(source.int_keys or None, pd)
    if why is not None:
        raise CorruptCheckpointError(f"{source.uri}: the record of integer keys {why}")
    if pd is None:
        return
    bound = max(len(source.items), 1)
    for key, path in pd.items():
        why = planner_path_problem(path, bound)
        if why is not None:
            raise CorruptCheckpointError(f"{source.uri}: planner_data for {key!r} {why}", key=key)


def read_small_capped(store: Store, name: str, limit: int, what: str) -> bytes | None:
    """The whole of a foreign checkpoint's small file (a metadata file, an index, a sidecar), or
    ``None`` when it is missing: the store's own capped read (``Store.read_small``, which refuses
    links, non-regular files and anything over ``limit`` before reading it), with the file named
    by what it is in the error.

    Raises:
        CorruptCheckpointError: the file is larger than ``limit``.
        CheckpointError: the store refuses the file (a link, not a regular file).
    """
    try:
        return store.read_small(name, max_bytes=limit)
    except FileTooLargeError as e:
        raise FileTooLargeError(f"{what}: {e}", path=e.path) from e
