"""Pieces shared by the tools: progress reporting, opening locations, which keys live where."""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping
from typing import Any, Protocol

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest, ObjectEntry, TensorEntry
from ..storage import Store, locations_overlap, open_store

__all__ = [
    "NO_PROGRESS",
    "KeyIndex",
    "Progress",
    "checksum_error",
    "open_location",
    "read_manifest_bytes",
    "require_positive",
    "same_location",
]


class Progress(Protocol):
    """How a tool reports progress: the CLI draws a bar, library callers may ignore it.

    ``start`` is called once per phase with the bytes the phase will process; ``advance`` may
    be called from worker threads (implementations must be thread-safe); ``close`` ends a phase.
    """

    def start(self, total: int, what: str) -> None: ...

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


class _NoProgress:
    def start(self, total: int, what: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


#: A :class:`Progress` that reports nothing (the default of every tool).
NO_PROGRESS: Progress = _NoProgress()


def open_location(uri: str | os.PathLike, options: Mapping[str, Any] | None = None) -> Store:
    """Open the store at ``uri`` (see :func:`goodput_ckpt.storage.open_store`)."""
    return open_store(uri, options)


def read_manifest_bytes(store: Store) -> bytes | None:
    """The raw manifest of ``store``, or ``None`` when it has none.

    Raises:
        CheckpointNotFoundError: the location is a plain file (a checkpoint is a directory).
    """
    if store.traits.local_path is not None and os.path.isfile(store.traits.local_path):
        raise CheckpointNotFoundError(
            f"{store.uri} is a file, not a checkpoint directory (to read a torch.save or "
            "safetensors file, convert it: goodput-ckpt convert SRC DST --to goodput)",
            path=store.uri,
        )
    return store.read_small(MANIFEST_NAME)


class KeyIndex:
    """Which state-dict keys own the bytes ``[lo, hi)`` of a data file (for problem reports).

    Built once per manifest; each query is a binary search, so reporting many problems in a
    large checkpoint stays cheap.
    """

    def __init__(self, manifest: Manifest) -> None:
        per_file: dict[str, list[tuple[int, int, str]]] = {}
        for key, e in manifest.items.items():
            if isinstance(e, TensorEntry):
                for c in e.chunks:
                    per_file.setdefault(c.file, []).append((c.offset, c.offset + max(c.length, 1), key))
            elif isinstance(e, ObjectEntry):
                per_file.setdefault(e.file, []).append((e.offset, e.offset + max(e.length, 1), key))
        self._ranges = {f: sorted(r) for f, r in per_file.items()}
        self._starts = {f: [r[0] for r in rs] for f, rs in self._ranges.items()}
        # Items never overlap (the manifest is validated), so the longest item bounds how far
        # back an overlapping one can start.
        self._longest = {f: max((e - s for s, e, _ in rs), default=0) for f, rs in self._ranges.items()}

    def keys(self, file: str, lo: int, hi: int) -> list[str]:
        """Keys (in file order, without repeats) whose bytes overlap ``[lo, hi)`` of ``file``."""
        ranges = self._ranges.get(file, [])
        starts = self._starts.get(file, [])
        i = bisect.bisect_left(starts, lo - self._longest.get(file, 0))
        out: list[str] = []
        while i < len(ranges) and ranges[i][0] < hi:
            s, e, key = ranges[i]
            if s < hi and lo < e and key not in out:
                out.append(key)
            i += 1
        return out


def checksum_error(uri: str, file: str, lo: int, hi: int, chunk: int, keys: list[str]) -> CorruptCheckpointError:
    """The error for a hash chunk whose blake3 does not match the manifest."""
    where = f"{uri}/{file}"
    joined = ", ".join(keys)
    return CorruptCheckpointError(
        f"checksum mismatch in {where}, bytes [{lo}, {hi}) (chunk {chunk}): the data changed "
        f"after it was written. Affected keys: {joined or 'padding only'}. Restore an earlier "
        "checkpoint or a replica.",
        path=where,
        byte_range=(lo, hi),
        key=joined,
    )


def require_positive(name: str, value: int | None) -> None:
    """``ValueError`` unless ``value`` is ``None`` or a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def same_location(a: Store | str, b: Store | str) -> bool:
    """Whether two locations are one place, or one lies inside the other: compared on disk for
    local paths (real paths, devices and inodes, so links and bind mounts count as the same
    place), by normalised prefix for remote URIs. Writing into such a destination could destroy
    the source."""
    return locations_overlap(a if isinstance(a, str) else a.uri, b if isinstance(b, str) else b.uri)
