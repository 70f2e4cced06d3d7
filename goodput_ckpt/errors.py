"""The exception hierarchy of goodput-ckpt.

Every error the library raises on purpose is a :class:`CheckpointError`. Each carries the
structured facts a user or a script needs to act on it (``path``, ``byte_range``, ``key``,
``version``) besides a message that says what is wrong, where, and what to do.

Note that ``torch.distributed.checkpoint`` wraps errors raised inside ``dcp.save``/``dcp.load``
into ``CheckpointException``, which derives from ``BaseException``; the original error and its
message are kept in its ``failures`` mapping. :func:`find_checkpoint_error` digs ours out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "FileTooLargeError",
    "TopologyChangeError",
    "as_checkpoint_error",
    "find_checkpoint_error",
    "find_interrupt",
    "remember_swallowed",
]

#: Errors whose type torch drops (see :func:`remember_swallowed`): message -> a copy without
#: its traceback (frames would keep tensors alive), the newest last. Bounded: only the errors
#: of the last few failed loads can still be asked about.
_SWALLOWED: OrderedDict[str, CheckpointError] = OrderedDict()
_SWALLOWED_MAX = 32
_SWALLOWED_LOCK = threading.Lock()  # loads on several threads remember errors concurrently


class CheckpointError(Exception):
    """Base class of every error goodput-ckpt raises on purpose.

    Attributes:
        path: the checkpoint location or file the error is about, when known.
        byte_range: ``(start, end)`` byte offsets (end exclusive) within ``path``, when known.
        key: the state-dict key (or keys, comma separated) affected, when known.
        version: the format version involved, for version errors.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        byte_range: tuple[int, int] | None = None,
        key: str | None = None,
        version: object | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.byte_range = byte_range
        self.key = key
        self.version = version

    def __reduce__(self):  # keep the structured fields when crossing processes (async_save)
        return (
            _rebuild_error,
            (type(self), str(self), self.path, self.byte_range, self.key, self.version),
        )


def _rebuild_error(cls, message, path, byte_range, key, version):
    return cls(message, path=path, byte_range=byte_range, key=key, version=version)


class IncompleteCheckpointError(CheckpointError):
    """The location holds checkpoint data but no valid commit record (manifest).

    A save was interrupted, is still running, or failed. The data must not be loaded.
    """


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is committed but its bytes or its manifest do not match what was written."""


class CheckpointExistsError(CheckpointError):
    """A save targets a location that already holds a committed checkpoint."""


#: How a Python caller replaces an existing checkpoint; the one wording of it in messages, so
#: that the CLI can show its own option in its place (``--overwrite``) instead of both.
OVERWRITE_HINT = "pass overwrite=True to replace it"


class CheckpointNotFoundError(CheckpointError):
    """Nothing resembling a checkpoint exists at the location."""


class FileTooLargeError(CorruptCheckpointError):
    """A small file of a checkpoint (its manifest, DCP metadata, an index) is over the size cap
    it is read under; it was refused before being read, so memory stays bounded."""


class TopologyChangeError(CheckpointError):
    """Per-rank training state (RNG, dataloader) was saved under another topology.

    Raised by :meth:`~goodput_ckpt.CheckpointManager.restore` when the world size, or the
    dataloader's worker count or batch size, differs from the saved one. Model and optimizer
    state reshard; per-rank state cannot. ``CheckpointManager(..., allow_topology_change=True)``
    opts in to the documented policy instead (docs/manager.md).
    """


def find_checkpoint_error(exc: BaseException) -> CheckpointError | None:
    """Return the first :class:`CheckpointError` inside ``exc``, or ``None``.

    Looks through ``__cause__``/``__context__`` chains and through the per-rank ``failures`` of
    torch's ``CheckpointException`` (whose entries wrap the original exception). When none is
    there, an error whose type torch dropped (a bare ``AssertionError`` from ``dcp.load`` that
    carries our message, see :func:`remember_swallowed`) is returned as the typed error.
    """
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, CheckpointError):
            return e
    texts = [str(e) for e in chain]
    with _SWALLOWED_LOCK:
        found = [err for msg, err in _SWALLOWED.items() if any(msg in t for t in texts)]
    return max(found, key=lambda err: len(str(err)), default=None)


def _chain(exc: BaseException):
    """Every exception reachable from ``exc``, each once, ``exc`` first."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend(err for _, err in _rank_errors(e))
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                stack.append(nxt)


def find_interrupt(exc: BaseException) -> KeyboardInterrupt | SystemExit | None:
    """The ``KeyboardInterrupt`` or ``SystemExit`` inside ``exc`` (``exc`` itself, its chain, or
    the per-rank ``failures`` of torch's ``CheckpointException``, which wraps a Ctrl-C that hits
    ``dcp.save``/``dcp.load``), or ``None``."""
    return next((e for e in _chain(exc) if isinstance(e, (KeyboardInterrupt, SystemExit))), None)


def _rank_errors(exc: BaseException) -> list[tuple[object, BaseException]]:
    """``(rank, error)`` for each rank's error inside torch's ``CheckpointException`` (its
    ``failures``), in its order; empty for any other exception."""
    failures = getattr(exc, "failures", None)
    out: list[tuple[object, BaseException]] = []
    if isinstance(failures, dict):
        for rank, wrapped in failures.items():
            # torch wraps each rank's error as (exception, traceback frames).
            parts = wrapped if isinstance(wrapped, tuple) else (getattr(wrapped, "exc", wrapped),)
            out.extend((rank, p) for p in parts if isinstance(p, BaseException))
    return out


def remember_swallowed(err: CheckpointError) -> None:
    """Remember ``err`` because torch is about to drop its type.

    Why: torch 2.13's ``dcp.load`` catches what ``StorageReader.read_metadata`` raises and
    raises ``AssertionError("metadata is None; global metadata read failed: <message>")``
    instead, with no cause or context: the message survives, the type and fields do not.
    :func:`find_checkpoint_error` recognises a remembered message inside such an error and
    returns the typed error (a copy, with ``path``, ``key``, ... kept).
    """
    message = str(err)
    if not message:
        return
    copy = _rebuild_error(type(err), message, err.path, err.byte_range, err.key, err.version)
    with _SWALLOWED_LOCK:
        _SWALLOWED.pop(message, None)
        _SWALLOWED[message] = copy
        while len(_SWALLOWED) > _SWALLOWED_MAX:
            _SWALLOWED.popitem(last=False)


def as_checkpoint_error(exc: BaseException, what: str) -> CheckpointError:
    """``exc`` as a :class:`CheckpointError`, for callers that promise to raise only ours.

    Returns the :class:`CheckpointError` inside ``exc`` (see :func:`find_checkpoint_error`), with
    ``exc`` as its cause when it has none; otherwise a new one that says ``what`` failed and why,
    chained to ``exc``. For torch's ``CheckpointException`` the why is the first rank's own error,
    not its text (a traceback per rank, the cause on the last line): the traceback stays on
    ``__cause__``.

    Raises:
        KeyboardInterrupt, SystemExit: the one inside ``exc`` (DCP wraps a Ctrl-C that hits a save
            or a load into its ``CheckpointException``). An interrupt is never turned into a
            ``CheckpointError``: code that catches those to keep training would swallow Ctrl-C.
    """
    stop = find_interrupt(exc)
    if stop is not None:
        raise stop from None  # its own traceback, not DCP's wrapping around it
    found = find_checkpoint_error(exc)
    if found is not None:
        if found.__cause__ is None and found is not exc:
            found.__cause__ = exc
        return found
    ranks = _rank_errors(exc)
    where, cause = (f" on rank {ranks[0][0]}", ranks[0][1]) if ranks else ("", exc)
    detail = str(cause).strip() or type(cause).__name__
    err = CheckpointError(f"{what} failed{where}: {type(cause).__name__}: {detail[:2000]}")
    err.__cause__ = exc
    return err
