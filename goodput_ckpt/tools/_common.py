"""Pieces shared by the tools: progress reporting, opening locations, argument checks. (Which
keys live where, and the checksum error, are in :mod:`goodput_ckpt.format.commit_record`.)"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Mapping
from typing import Any, Protocol

from ..errors import CheckpointNotFoundError
from ..storage import Store, locations_overlap, open_store

__all__ = [
    "NO_PROGRESS",
    "Progress",
    "open_location",
    "is_dcp_location",
    "refuse_plain_file",
    "sniff_file",
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


def sniff_file(path: str) -> str | None:
    """``"safetensors"``, ``"torch"`` (a ``torch.save`` zip archive or legacy pickle) or ``None``,
    from a local file's first bytes: the one recognition of single-file checkpoints."""
    with open(path, "rb") as f:
        head = f.read(9)
    size = os.path.getsize(path)
    if len(head) == 9 and head[8:9] == b"{" and 8 + struct.unpack("<Q", head[:8])[0] <= size:
        return "safetensors"
    if zipfile.is_zipfile(path) or head[:1] == b"\x80":  # torch's zip archive, or a legacy pickle
        return "torch"
    return None


_FILE_KINDS = {"torch": "a torch.save file", "safetensors": "a safetensors file", None: "a file"}


def refuse_plain_file(store: Store) -> None:
    """Say so, naming the file's type, when the location is a plain file: a checkpoint is a
    directory. Every command that reads a checkpoint directory calls this first (one detection,
    one message, exit status 2 on the command line).

    Raises:
        CheckpointNotFoundError: the location is a local file.
    """
    path = store.traits.local_path
    if path is None or not os.path.isfile(path):
        return
    try:
        kind = sniff_file(path)
    except OSError:
        kind = None
    raise CheckpointNotFoundError(
        f"{store.uri} is {_FILE_KINDS[kind]}, not a checkpoint directory"
        + (f"; convert it first: goodput-ckpt convert {store.uri} DST --to goodput" if kind else ""),
        path=store.uri,
    )


#: torch DCP's commit record (``FileSystemWriter``), the mark of a stock DCP checkpoint.
DCP_METADATA_NAME = ".metadata"


def is_dcp_location(store: Store) -> bool:
    """A stock torch DCP checkpoint: DCP's ``.metadata`` and no goodput manifest (which wins)."""
    from ..format.manifest import MANIFEST_NAME

    return store.size(DCP_METADATA_NAME) is not None and store.size(MANIFEST_NAME) is None


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
