"""Pieces shared by the tools: progress reporting, opening locations, argument checks. (Which
keys live where, and the checksum error, are in :mod:`goodput_ckpt.format.commit_record`.)"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from ..errors import CheckpointNotFoundError
from ..storage import Store, locations_overlap, open_store

__all__ = [
    "NO_PROGRESS",
    "Progress",
    "open_location",
    "refuse_plain_file",
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


def refuse_plain_file(store: Store) -> None:
    """Say so when the location is a plain file: a checkpoint is a directory.

    Raises:
        CheckpointNotFoundError: the location is a local file.
    """
    if store.traits.local_path is not None and os.path.isfile(store.traits.local_path):
        raise CheckpointNotFoundError(
            f"{store.uri} is a file, not a checkpoint directory (to read a torch.save or "
            "safetensors file, convert it: goodput-ckpt convert SRC DST --to goodput)",
            path=store.uri,
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
