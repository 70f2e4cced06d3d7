"""Reading a committed manifest: the commit record, parsed, validated and checked against the
files it lists, and which keys a damaged byte range holds (for error messages)."""

from __future__ import annotations

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest, TensorEntry, parse_manifest
from ..storage import Store
from ..storage.base import parse_commit_record

__all__ = ["keys_in", "load_manifest"]


def load_manifest(store: Store) -> Manifest:
    """Read, parse and validate the manifest of ``store``, and check every file's size.

    Raises:
        CheckpointNotFoundError: nothing is stored at the location.
        IncompleteCheckpointError: files exist but no manifest does (an uncommitted save); on a
            store whose commit record is not atomic (a mounted volume), also a manifest that
            does not parse or validate.
        CorruptCheckpointError: the manifest is invalid, or a file is missing or of the wrong size.
    """
    data = store.read_small(MANIFEST_NAME)
    if data is None:
        names = store.list()
        if names:
            raise IncompleteCheckpointError(
                f"{store.uri} holds {len(names)} file(s) but no {MANIFEST_NAME}: the save that "
                "wrote them never committed (interrupted, failed or still running). Load an "
                "earlier checkpoint.",
                path=store.uri,
            )
        raise CheckpointNotFoundError(f"no checkpoint at {store.uri}", path=store.uri)
    manifest = parse_commit_record(store, MANIFEST_NAME, data, lambda d: parse_manifest(d, location=store.uri))
    for f in manifest.files.values():
        actual = store.size(f.path)
        where = f"{store.uri}/{f.path}"
        if actual is None:
            raise CorruptCheckpointError(
                f"data file {where} listed in the manifest is missing; keys stored in it: "
                f"{keys_in(manifest, f.path, 0, f.size)}",
                path=where,
                byte_range=(0, f.size),
                key=keys_in(manifest, f.path, 0, f.size),
            )
        if actual != f.size:
            lo, hi = sorted((actual, f.size))
            raise CorruptCheckpointError(
                f"data file {where} is {actual} bytes but the manifest records {f.size}: it was "
                f"{'truncated' if actual < f.size else 'extended'}; bytes [{lo}, {hi}) are "
                f"affected (keys: {keys_in(manifest, f.path, lo, hi) or 'padding only'})",
                path=where,
                byte_range=(lo, hi),
                key=keys_in(manifest, f.path, lo, hi),
            )
    return manifest


def keys_in(manifest: Manifest, file: str, lo: int, hi: int) -> str:
    """Comma-separated keys whose bytes overlap ``[lo, hi)`` of ``file`` (for error messages)."""
    keys = []
    for key, e in manifest.items.items():
        ranges = [(c.file, c.offset, c.length) for c in e.chunks] if isinstance(e, TensorEntry) else [(e.file, e.offset, e.length)]
        if any(f == file and off < hi and lo < off + max(n, 1) for f, off, n in ranges):
            keys.append(key)
    return ", ".join(keys)
