"""The rules every store follows, written once: the typed errors a read or write raises, a
bounded read of a small file, vectored-I/O buffer views, safe relative names, and the masking
of credentials in URLs.

Split from ``storage/base.py`` (the interface: :class:`~.base.Store`, its traits and optional
abilities), which re-exports every name here, so ``from goodput_ckpt.storage.base import
redact`` keeps working. No torch, like the rest of ``storage/``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Sequence

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    FileTooLargeError,
    IncompleteCheckpointError,
)

__all__ = [
    "Buffer",
    "byte_views",
    "check_relative_name",
    "committed_elsewhere_error",
    "drop_done",
    "missing_file_error",
    "out_of_order_error",
    "read_capped",
    "redact",
    "too_large_error",
    "truncated_error",
]

#: Anything exposing the buffer protocol: ``bytes``, ``bytearray``, ``memoryview``, numpy arrays.
Buffer = object


#: The user-info part of a URL: everything from ``://`` to the last ``@`` before the path
#: (a password may itself hold an ``@``).
_USERINFO = re.compile(r"://[^/\s]*@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@``) masked.

    Applied to every location a store keeps for messages (``uri``) and to the messages of errors
    that quote a URL, so a secret given in a URL never reaches an error, a log or ``--json``.
    """
    return _USERINFO.sub("://***@", text)


def missing_file_error(where: str) -> IncompleteCheckpointError:
    """A data file that a read needs is not there."""
    return IncompleteCheckpointError(
        f"data file {where} is missing: the checkpoint is incomplete or was tampered with", path=where
    )


def truncated_error(where: str, start: int, end: int, at: int | None = None) -> IncompleteCheckpointError:
    """A data file ends (at byte ``at``, when known) before the range ``[start, end)`` a read needs."""
    ends = f"ends at byte {at}" if at is not None else "ends"
    return IncompleteCheckpointError(
        f"data file {where} {ends}, before the range [{start}, {end}) the manifest records: the file is truncated",
        path=where,
        byte_range=(start, end),
    )


def committed_elsewhere_error(where: str) -> CheckpointExistsError:
    """A commit without ``replace`` found a record that another writer committed meanwhile."""
    return CheckpointExistsError(
        f"{where} was committed by another writer while this save ran; nothing was overwritten", path=where
    )


def out_of_order_error(where: str, expected: int, got: int) -> CheckpointError:
    """A write to a store without ``random_writes`` that does not continue where the last ended."""
    return CheckpointError(
        f"{where} is written strictly in order on this store: expected offset {expected}, got {got} (a writer bug)",
        path=where,
        byte_range=(min(expected, got), max(expected, got)),
    )


def too_large_error(where: str, size: int | None, limit: int) -> FileTooLargeError:
    """A small file (manifest, metadata) is larger than its reader's cap."""
    holds = f"holds {size} bytes" if size is not None else "is larger than that"
    return FileTooLargeError(
        f"{where} {holds}, over the {limit}-byte limit for this file; it is not read "
        "(a damaged or hostile checkpoint, or a link to an endless file)",
        path=where,
    )


def read_capped(read: Callable[[int], bytes], where: str, max_bytes: int, expected: int = 0) -> bytes:
    """Read a stream to its end, refusing more than ``max_bytes``, with memory bounded by what
    the stream really holds.

    ``read(n)`` of a file or an HTTP body reserves ``n`` bytes before reading, so asking for
    ``max_bytes + 1`` at once would allocate the cap (1 GiB) for every small file. ``expected``
    (the size the store announced) is read in one call; anything past it in steps of 1 MiB.

    Raises:
        FileTooLargeError: the stream holds more than ``max_bytes``.
    """
    parts: list[bytes] = []
    total = 0
    step = min(expected, max_bytes) + 1
    while total <= max_bytes:
        ask = min(step, max_bytes + 1 - total)
        more = read(ask)
        parts.append(more)
        total += len(more)
        if len(more) < ask:  # a file or HTTP body comes up short only at its end
            break
        step = 1 << 20  # it grew past what was announced: go on in small steps
    if total > max_bytes:
        raise too_large_error(where, None, max_bytes)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """``buffers`` as flat byte views (what vectored I/O and copies take)."""
    return [memoryview(b).cast("B") for b in buffers]


def drop_done(views: list[memoryview], done: int) -> None:
    """Remove the first ``done`` bytes from ``views``, in place: what a vectored read or write
    (``preadv``/``pwritev``/``writev``) moved, so a short one continues with the rest."""
    while views and done >= views[0].nbytes:
        done -= views[0].nbytes
        views.pop(0)
    if views and done:
        views[0] = views[0][done:]


def check_relative_name(name: object) -> str:
    """Validate a file name taken from a manifest or computed by the writer.

    A name is a relative POSIX path: not empty, not absolute, no backslashes or NUL bytes, no
    ``.``/``..`` components. Returns the name unchanged.

    Raises:
        CheckpointError: the name is not a safe relative path.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"invalid file name {name!r}: expected a non-empty string")
    bad = (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or posixpath.isabs(name)
        or (len(name) > 1 and name[1] == ":")
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CheckpointError(
            f"unsafe file name {name!r}: checkpoint files must be relative paths without "
            "'..', '.', empty components, backslashes or drive letters",
            path=name,
        )
    return name
