"""Operations on many files of a store at once, in as few requests as the store allows.

One home for each: :func:`delete_files` (retention) and :func:`file_sizes` (the size check
before a load, ``verify``, ``inspect``). A store that can do better declares it with a small
protocol of :mod:`.base` (:class:`~.base.BatchDelete`, :class:`~.base.SizedListing`: S3);
every other store gets the one-file-at-a-time loop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError
from .base import BatchDelete, SizedListing, Store

__all__ = ["delete_files", "file_sizes"]


def delete_files(store: Store, names: Sequence[str]) -> None:
    """Delete ``names`` from ``store``: in batches where it can (:class:`BatchDelete`), one
    ``delete`` each otherwise. Callers needing an order (a commit record before the files it
    commits) make separate calls: a batch is deleted in no promised order.

    Raises:
        CheckpointError: a file could not be deleted.
    """
    if not names:
        return
    if isinstance(store, BatchDelete):
        store.delete_many(names)
        return
    for name in names:
        store.delete(name)


#: Objects a size listing may read beyond the names asked for (one S3 page): the commit record
#: and a few leftovers fit; past that, the names not yet seen are asked for one by one.
_LISTING_SLACK = 1000

#: Size requests in flight at once when a listing store's files are asked for one by one.
_HEAD_THREADS = 32


def file_sizes(store: Store, names: Collection[str]) -> dict[str, int | None]:
    """``{name: size, or None when missing}`` for ``names``.

    Why: checking a checkpoint's files before a restore asks one size per file; on S3 that is a
    ``HEAD`` each (16,384 sequential requests at 16,384 ranks), while one listing returns 1,000
    sizes a request. The listing stops after about as many objects as names (plus a page), so a
    location holding much else costs at most that many pages more than a ``HEAD`` each. Stores
    whose listing carries sizes (:class:`SizedListing`) answer from it; the others (a local
    disk, where a ``stat`` is cheap) ask ``size`` per file, and so does a store that refuses
    the listing.

    Raises:
        CheckpointError: a file cannot be examined.
    """
    sizes: dict[str, int | None] = {}
    if isinstance(store, SizedListing) and names:
        try:
            # Bounded: a location that holds much more than these files (a checkpoint at a
            # bucket's root, nested locations) costs at most a page more than the names need.
            listed = store.list_sizes(max_entries=len(names) + _LISTING_SLACK)
        except CheckpointError:
            listed = {}  # no permission to list (a read-only policy): ask each file instead
        sizes = {n: listed[n] for n in names if n in listed}
    # Files the listing did not show are asked for one by one: a missing file is a rare event,
    # and this way a listing that lags behind a write never reports a file that exists as missing.
    # On a listing store (an object store, one round trip per request) all of them when the
    # listing was refused, so they are asked for in parallel: 16,384 sequential HEADs at 10 ms
    # are 164 s, on _HEAD_THREADS threads 5 s (the store's client is thread-safe).
    asked = [n for n in names if n not in sizes]
    if isinstance(store, SizedListing) and len(asked) > 1:
        with ThreadPoolExecutor(min(_HEAD_THREADS, len(asked)), thread_name_prefix="goodput-sizes") as pool:
            sizes.update(zip(asked, pool.map(store.size, asked)))
    else:
        sizes.update((n, store.size(n)) for n in asked)
    return {n: sizes[n] for n in names}
