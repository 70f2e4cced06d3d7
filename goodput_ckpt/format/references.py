"""References: data files that a manifest lists but a sibling location holds (an incremental save).

A manifest of version 3 (docs/format.md, "References") may give a file entry a ``base``: the
name of another location under the same parent (``step_00000100`` beside ``step_00000200``).
The file's bytes are then ``<parent>/<base>/<file>``, and the entry carries their size and chunk
digests exactly like a file of the location itself, so a reader checks them the same way and
never needs the other location's manifest.

:func:`with_references` hands a reader a store in which those names resolve: a file with a base
is opened *through the parent store* as ``<base>/<file>``, so the parent's rules on names apply
(no ``..``, on local disk no symbolic link anywhere on the way). Everything else goes to the
location's own store, unchanged. No torch here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import CorruptCheckpointError
from ..storage.base import FileSource, Store
from ..storage.siblings import parent_store
from .schema import FORMAT_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, REFERENCES_VERSION, SUPPORTED_VERSIONS, Manifest
from .seal import check_seal

__all__ = ["MAX_BASE_LENGTH", "ReferencingStore", "base_problem", "sealed_bases", "with_references"]

#: A base is one path component of a portable name: a letter or digit, then letters, digits,
#: ``.``, ``_`` and ``-`` (so never ``.``, ``..``, a slash, a backslash or a drive letter).
MAX_BASE_LENGTH = 255
_BASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


def base_problem(base: object) -> str | None:
    """Why ``base`` is not a valid sibling name, or ``None`` when it is."""
    if not isinstance(base, str):
        return f"must be a string, not {type(base).__name__}"
    if not 1 <= len(base) <= MAX_BASE_LENGTH or not _BASE.match(base):
        return (
            f"{base[:80]!r} is not one path component of 1 to {MAX_BASE_LENGTH} letters, digits, '.', '_' "
            "or '-' starting with a letter or digit"
        )
    return None


def sealed_bases(data: bytes) -> frozenset[str] | None:
    """The bases a commit record's raw bytes name, when they are a sealed record of a version this
    library reads; ``None`` for anything else (the caller then reads the record in full, which
    says what is wrong with it).

    Why: retention and a restore's clean-up ask every kept step which steps it references, and a
    full parse validates every tensor entry (about 30 ms for a GPT-2 record here, against about
    1 ms for the JSON alone), which made a restore of a root with an incremental step ~10% slower
    than of one without. The seal (its own digest over every byte before it) already tells that
    these are the bytes a writer produced after validating them; only what retention reads is
    checked again: the ``files`` table's shape and each ``base`` (:func:`base_problem`).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        return None
    try:
        check_seal(data, MANIFEST_NAME)  # (its message is not used)
        doc = json.loads(data.decode("utf-8"))
    except (CorruptCheckpointError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        return None
    version = doc.get("version")
    files = doc.get("files")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS or not isinstance(files, dict):
        return None
    bases: set[str] = set()
    for entry in files.values():  # bounded by the record's size
        if not isinstance(entry, dict):
            return None
        base = entry.get("base")
        if base is not None:
            if version < REFERENCES_VERSION or base_problem(base) is not None:
                return None
            bases.add(base)
    return frozenset(bases)


class ReferencingStore:
    """``inner`` (a checkpoint location) with the referenced files of ``manifest`` resolved in
    its parent. Reads of referenced files go to the parent; everything else (writes, deletes,
    listings, the commit record) to ``inner``: a referencing location never deletes or writes
    another location's files through this store."""

    def __init__(self, inner: Store, manifest: Manifest) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.traits = inner.traits
        self._parent = parent_store(inner)
        self._routes = {f.path: f"{f.base}/{f.path}" for f in manifest.files.values() if f.base is not None}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def where(self, name: str) -> str:
        """Where the file ``name`` lives, for messages."""
        routed = self._routes.get(name)
        return f"{self._parent.uri.rstrip('/')}/{routed}" if routed is not None else f"{self.uri}/{name}"

    def open_source(self, name: str) -> FileSource:
        routed = self._routes.get(name)
        return self.inner.open_source(name) if routed is None else self._parent.open_source(routed)

    def size(self, name: str) -> int | None:
        routed = self._routes.get(name)
        return self.inner.size(name) if routed is None else self._parent.size(routed)


def with_references(store: Store, manifest: Manifest) -> Store:
    """``store`` itself when ``manifest`` references no other location, else a
    :class:`ReferencingStore` over it.

    Raises:
        CheckpointError: the manifest has references but the store has no parent to resolve
            them in (:func:`~goodput_ckpt.storage.siblings.parent_store`).
    """
    if isinstance(store, ReferencingStore) or not any(f.base is not None for f in manifest.files.values()):
        return store
    return ReferencingStore(store, manifest)
