"""One manifest read per load, not one per rank: the coordinator reads it and broadcasts it.

``dcp.load`` calls ``read_metadata`` on every rank. Reading the manifest there on each rank costs
N requests for the manifest plus N x F size checks (F data files) against the store, which on an
object store with thousands of ranks is a burst of small requests that throttling punishes, and
it lets ranks see different states of a location that changes under them. Instead rank 0 of the
load's group reads and checks the manifest once, and broadcasts the result, or its error, to
the others, which raise the same error. Nothing here depends on the store.

What crosses the process group is the parsed manifest, pickled by rank 0 of this same job: no
bytes from the checkpoint location are unpickled.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointError
from ..format.gc_pause import gc_paused
from .collectives import Group

__all__ = ["load_shared"]

T = TypeVar("T")


def load_shared(load: Callable[[], T], *, group: Any = None, enabled: bool = True) -> T:
    """``load()`` on rank 0 of ``group``, broadcast to its other ranks; plain ``load()`` when
    sharing is off, ``torch.distributed`` is not initialized, or the group has one rank.

    Every rank of ``group`` (default: the default group) must call this together, as
    ``dcp.load`` does with ``read_metadata``.

    Raises:
        CheckpointError: what ``load`` raised on rank 0 (there: the original exception).
    """
    shared = Group.default(group) if enabled else Group(None)
    if shared.single:
        return load()
    data: bytes | None = None
    error: BaseException | None = None
    first = shared.rank == 0
    if first:
        try:
            result: tuple[str, Any] = ("ok", load())
        except CheckpointError as e:
            error = e
            result = ("error", e)
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait for a result forever
            error = e
            result = ("error", CheckpointError(f"rank 0 could not read the manifest: {type(e).__name__}: {e}"))
        data = _encode(result)
    # Only the bytes cross the group (pickling bytes makes no objects): the record's own
    # pickling and unpickling, which make one object per entry, run with the collector paused
    # on their own, not for the whole collective (a wait as long as rank 0's read, or a hang).
    data = shared.broadcast(data)
    kind, value = result if first else _decode(data)
    if kind == "error":
        if error is not None:
            raise error
        raise value
    return value


def _encode(result: tuple[str, Any]) -> bytes:
    """Rank 0's result as bytes (pickled here, in this job: never bytes from the checkpoint)."""
    with gc_paused():
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(data: bytes) -> tuple[str, Any]:
    """What :func:`_encode` made on rank 0 of this job's group."""
    with gc_paused():
        return pickle.loads(data)  # noqa: S301 - rank 0 of this job pickled it, see the module doc
