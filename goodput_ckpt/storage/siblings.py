"""The parent of a checkpoint location, opened as a store with the same configuration.

An incremental save's manifest references data files that a sibling location (another step
under the same manager root) holds (docs/format.md, "References"). A reader resolves such a file
as ``<sibling>/<file>`` *inside the parent store*, so every check the store makes on a name
applies to it: a relative name with no ``.``/``..`` part, and on local disk and volumes no
symbolic link anywhere on the way (``LocalStore._path``, ``O_NOFOLLOW``). A sibling reached
through a link is refused, not followed.

Only this package knows the concrete classes, so this is where a parent is built. Stores whose
parent cannot be expressed (a generic fsspec URL) refuse references by name.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from ..errors import CheckpointError
from .base import Store
from .local import LocalStore
from .s3 import S3Store
from .staged import StagedStore
from .volume import VolumeStore

__all__ = ["parent_store"]


#: Parents opened lately, by (class, uri): an S3 store builds its client on first use (tens of
#: ms), and a load asks for the parent twice (the size check, the reads). Reused only with the
#: very same configuration object.
_PARENTS: OrderedDict[tuple[type, str], tuple[object, Store]] = OrderedDict()
_PARENTS_LOCK = threading.Lock()
_PARENTS_MAX = 16


def parent_store(store: Store) -> Store:
    """The location that holds ``store``'s location, with the same backend and configuration.

    Raises:
        CheckpointError: the store has no parent this library can open (an fsspec URL, a
            location at the root of a filesystem or bucket).
    """
    key = (type(store), store.uri)
    config = getattr(store, "config", store)  # a store without a config is reused only for itself
    with _PARENTS_LOCK:
        hit = _PARENTS.get(key)
        if hit is not None and hit[0] is config:
            _PARENTS.move_to_end(key)
            return hit[1]
    parent = _open_parent(store)
    with _PARENTS_LOCK:
        _PARENTS[key] = (config, parent)
        while len(_PARENTS) > _PARENTS_MAX:
            _PARENTS.popitem(last=False)
    return parent


def _open_parent(store: Store) -> Store:
    if isinstance(store, StagedStore):  # reads go to the volume
        store = store.inner
    if isinstance(store, VolumeStore):
        parent = os.path.dirname(store.root)
        if parent != store.root:
            return VolumeStore(parent, store.config, detected=store.detected)
    elif isinstance(store, LocalStore):
        parent = os.path.dirname(store.root)  # the real path: links were resolved once, at open
        if parent != store.root:
            return LocalStore(parent, store.config)
    elif isinstance(store, S3Store):
        if store.prefix:
            head = store.prefix.rpartition("/")[0]
            return S3Store(f"s3://{store.bucket}/{head}" if head else f"s3://{store.bucket}", store.config)
    raise CheckpointError(
        f"{store.uri} references data files of another location, but this store has no parent "
        "location goodput-ckpt can open (references need a local directory, a mounted volume or an "
        "S3 prefix below the bucket)",
        path=store.uri,
    )
