"""Guards around ``torch.load`` of bytes nobody vouches for: bounded inflation, honest refusals.

Non-tensor values are ``torch.save`` archives, decoded with ``weights_only=True``. Two things
that restriction does not cover are handled here, once, for every place that decodes them (the
DCP reader and the converters):

- A zip archive may hold deflated entries, and ``torch.load`` inflates them: a 216 KB
  checkpoint held a value that inflated to 1 GB. ``torch.save`` itself always stores entries
  uncompressed, so an archive whose entries declare more bytes than it stores (plus
  :data:`MAX_INFLATION` of slack for foreign writers) is refused before it is decoded. The
  declared sizes bound the decoder: torch allocates each record at its declared size and the
  inflater stops there.
- ``weights_only`` builds any graph of lists, tuples and dicts the pickle describes: a list
  that contains itself, or sublists shared so often that a walk which does not remember what
  it saw takes exponential time. :func:`walk_state` walks a decoded value once per container,
  refusing cycles and nesting deeper than :data:`MAX_STATE_DEPTH` by name.
- torch's refusal message is long, carries ANSI codes, and names the refused global near its
  end, so cutting it short hid the one fact a user needs. :func:`weights_only_refusal` keeps
  that fact and drops the codes.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ..errors import CorruptCheckpointError

__all__ = ["MAX_INFLATION", "MAX_STATE_DEPTH", "check_inflation", "walk_state", "weights_only_refusal"]

#: How many bytes a value's archive may decode to beyond the bytes it stores. torch.save
#: never compresses, so its archives never use any of this.
MAX_INFLATION = 1 << 20
#: How deeply the lists, tuples and dicts of a decoded value may nest. A ``StatefulDataLoader``
#: state nests about 6 deep (loader, snapshot, worker snapshots, fetcher, dataset, sampler).
MAX_STATE_DEPTH = 64
_ZIP_MAGIC = b"PK\x03\x04"  # torch tells a zip archive from a legacy pickle by these bytes
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Please file an issue", "(1)", "(2)")
_GLOBAL = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+)"),
    re.compile(r"Unsupported global: GLOBAL (\S+)"),
)


def check_inflation(archive: bytes | str | os.PathLike | BinaryIO, what: str, *, key: str | None = None) -> None:
    """Refuse a ``torch.save`` archive whose entries decode to much more than it stores.

    Args:
        archive: the archive's bytes, the path of a file holding it, or a seekable binary
            file positioned at its start, whose end is the archive's end (left at its start).
        what: how to name it in the error (a key or a path).
        key: the state-dict key, carried by the error.

    Raises:
        CorruptCheckpointError: the archive would inflate past the limit, or starts as a zip
            archive that cannot be read as one (torch would still try to).
    """
    if isinstance(archive, (bytes, bytearray, memoryview)):
        declared, stored = _declared(io.BytesIO(archive), what, key)
    elif hasattr(archive, "read"):
        declared, stored = _declared(archive, what, key)
    else:
        with open(archive, "rb") as fh:
            declared, stored = _declared(fh, what, key)
    if declared is None:
        return  # a legacy pickle: nothing in it is compressed
    limit = stored + MAX_INFLATION
    if declared > limit:
        raise CorruptCheckpointError(
            f"{what} stores {stored} bytes that decode to {declared}: over the limit of its stored size plus "
            f"{MAX_INFLATION} bytes (a compressed archive; torch.save never writes one)",
            key=key,
        )


def _declared(f: BinaryIO, what: str, key: str | None) -> tuple[int | None, int]:
    """(bytes the entries declare, or ``None`` for no zip archive; bytes stored); ``f`` is
    left at its start."""
    try:
        head, stored = f.read(4), f.seek(0, io.SEEK_END)
        f.seek(0)
        if head != _ZIP_MAGIC:
            return None, stored
        z = zipfile.ZipFile(f)  # not closed: that would close the caller's file
        return sum(info.file_size for info in z.infolist()), stored
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(f"{what} is not a readable zip archive ({e})", key=key) from None
    finally:
        f.seek(0)


def walk_state(
    state: Any, what: str, *, key: str | None = None, enter: Callable[[Any], bool] | None = None
) -> Iterator[Any]:
    """Every dict, list and tuple in ``state``, each once, depth first in order (dict values,
    not keys): a container shared by several parents is entered the first time only, so the
    walk costs one step per container and reference whatever the sharing.

    Args:
        state: a value ``torch.load(weights_only=True)`` decoded.
        what: how to name it in the error (a key, a row).
        key: the state-dict key, carried by the error.
        enter: called on each container yielded; ``False``: do not walk inside it.

    Raises:
        CorruptCheckpointError: a container holds itself (directly or further down), or the
            nesting is deeper than :data:`MAX_STATE_DEPTH`.
    """
    containers = (dict, list, tuple)
    if not isinstance(state, containers):
        return
    seen: set[int] = set()  # every container yielded; ids stay valid: ``state`` holds them all
    path: list[int] = []  # ids of the containers on the way down to the current one
    on_path: set[int] = set()
    stack: list[Iterator[Any]] = []

    def push(x: Any) -> None:
        seen.add(id(x))  # yielded once, entered or not
        if enter is not None and not enter(x):
            return
        if len(path) >= MAX_STATE_DEPTH:
            raise CorruptCheckpointError(f"{what} nests deeper than {MAX_STATE_DEPTH} levels", key=key)
        path.append(id(x))
        on_path.add(id(x))
        stack.append(iter(x.values() if isinstance(x, dict) else x))

    yield state
    push(state)
    while stack:
        child = next(stack[-1], _END)
        if child is _END:
            stack.pop()
            on_path.discard(path.pop())
        elif isinstance(child, containers):
            if id(child) in on_path:
                raise CorruptCheckpointError(
                    f"{what} contains itself: a {type(child).__name__} {len(path)} level(s) down holds one "
                    "of the containers it is inside (a cycle)",
                    key=key,
                )
            if id(child) not in seen:
                yield child
                push(child)


_END = object()


def weights_only_refusal(e: BaseException) -> str:
    """A one-line account of why ``torch.load(weights_only=True)`` refused, naming the
    refused global where torch names one, without terminal escape codes."""
    text = _ANSI.sub("", str(e))
    for pattern in _GLOBAL:
        m = pattern.search(text)
        if m:
            return f"{type(e).__name__}: the unpickler refused the global {m.group(1).rstrip('.,')}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Skip torch's boilerplate (what weights_only is, where its docs are) for the cause.
    detail = next((ln for ln in lines if not ln.startswith(_BOILERPLATE)), lines[0] if lines else "")
    if len(detail) > 300:
        detail = detail[:300] + "..."
    return f"{type(e).__name__}: {detail}"
