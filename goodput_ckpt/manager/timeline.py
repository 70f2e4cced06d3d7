"""The per-save timeline: what every checkpoint cost the training loop, one JSON line per event.

:class:`~goodput_ckpt.CheckpointManager` records one event per save and per restore on every
rank, so the goodput of a real run can be computed afterwards (``goodput-ckpt plan`` and
``goodput-ckpt demo`` read it). A record is a flat JSON object::

    {"event": "save", "step": 100, "rank": 0, "world_size": 2, "time": 1733150000.1,
     "async": true, "wait_s": 0.0, "stage_s": 0.004, "guard_s": 0.0, "stall_s": 0.004,
     "write_s": 0.35, "durable_s": 0.35, "bytes": 104857600, "gbps": 0.30, "ok": true, "error": null}
    {"event": "restore", "step": 100, "rank": 0, "world_size": 2, "time": ..., "seconds": 0.4,
     "bytes": 104857600, "ok": true, "error": null}

- ``time``: wall-clock start of the event (Unix seconds).
- ``stall_s``: how long the save blocked the training loop: ``wait_s`` (waiting for the previous
  save to finish) plus ``stage_s`` (the part of the copy into the reused buffers made in
  ``save``) plus ``guard_s`` (with async staging, how long the next optimizer steps waited for
  the rest of that copy). For a synchronous save it is the whole save.
- ``write_s``: the background part, from the hand-off to the save thread until the checkpoint
  was committed; ``durable_s`` until it was durable at its final location (later than the commit
  only with local staging onto a volume). ``gbps`` = ``bytes`` / ``write_s`` / 1e9.
- ``bytes``: this rank's tensor payload (its shards of the model and optimizer state).
- Incremental saves (``CheckpointManager(incremental=...)``) add ``written_bytes`` (the data-file
  bytes this rank wrote) and ``referenced_bytes`` (its tensor bytes referenced in earlier steps).
- Two tiers (``local_dir``): save records add ``tier`` (``"local"``) and ``replicate_s``; each
  persist is a ``{"event": "persist", "step", "seconds", "bytes", "ok", "error", ...}`` record;
  restore records add ``sources``, data files read per tier (``{"local": 3, "replica": 1}``).
- Restores with a ``dataloader=`` add ``loader_states``: how many ranks' saved dataloader states
  this rank read from storage (its own: 1; an elastic restore: the old world size on the
  coordinator and 0 on the other ranks, which receive them from it; 0 when none was restored).

In code a record is a :class:`SaveRecord` or a :class:`RestoreRecord`; the save job
(:mod:`.save_job`) is the one place that fills a save's record in, and :meth:`SaveRecord.to_json`
the one place that names the fields above.

Where the lines go is the manager's ``timeline=`` option: by default a file
``ROOT/goodput-timeline.jsonl`` when the root is a local directory (each rank appends whole lines
with ``O_APPEND``, which local filesystems keep unmixed), any local path, a callable that receives
each record, or ``False``. Object stores and volumes cannot append, so for those roots the
default keeps the records in memory only (:attr:`CheckpointManager.timeline`); pass a local path
or a callable to keep them.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TIMELINE_NAME",
    "PersistRecord",
    "RestoreRecord",
    "SaveRecord",
    "TimelineSink",
    "read_timeline",
    "summarize_timeline",
    "tensor_nbytes",
]

#: The default timeline file name under a local manager root.
TIMELINE_NAME = "goodput-timeline.jsonl"

Record = dict[str, Any]

logger = logging.getLogger("goodput_ckpt.timeline")

#: Restore records of one step that start this close together belong to one restore of the job.
RESTORE_WINDOW_S = 60.0

#: Records a manager keeps in memory (the newest ones); the file keeps them all.
MEMORY_RECORDS = 10_000


@dataclass(kw_only=True, eq=False)
class SaveRecord:
    """The timeline record of one save (fields: the module docstring; ``is_async`` is ``async``).

    Filled in by the save job in this order: created when the state is built, :meth:`staged`
    (async saves) once ``save`` returns, :meth:`guarded` and :meth:`written` on the save thread,
    :meth:`finish` at the end, then emitted.
    """

    step: int
    rank: int
    world_size: int
    time: float
    is_async: bool
    wait_s: float
    bytes: int
    stage_s: float = 0.0
    guard_s: float = 0.0
    stall_s: float = 0.0
    write_s: float | None = None
    durable_s: float | None = None
    gbps: float | None = None
    ok: bool = False
    error: str | None = None
    replicate_s: float | None = None  # two tiers: sending and receiving the replicas
    tier: str | None = None  # two tiers: "local" (every save there; persists are their own records)
    written_bytes: int | None = None  # incremental saves: the data-file bytes this rank wrote
    referenced_bytes: int | None = None  # incremental saves: item bytes referenced in earlier steps

    def staged(self, *, stage_s: float, stall_s: float) -> None:
        """An async save's staging is done: ``save`` blocked for ``stall_s`` in all."""
        self.stage_s, self.stall_s = stage_s, stall_s

    def guarded(self, guard_s: float) -> None:
        """The optimizer steps waited ``guard_s`` for the deferred copies: more stall."""
        self.guard_s = guard_s
        self.stall_s += guard_s

    def written(self, write_s: float) -> None:
        """The checkpoint was committed ``write_s`` after the hand-off (or the start, if sync)."""
        self.write_s = write_s

    def finish(self, since: float, error: str | None, *, stall_from: float | None = None) -> None:
        """Complete the record now: ``since`` is when its write started and ``stall_from``, for
        a synchronous save, when the caller started to block (``time.perf_counter()`` values)."""
        now = time.perf_counter()
        self.durable_s = now - since
        if self.write_s is None:
            self.write_s = now - since
        if stall_from is not None:  # a synchronous save blocks for all of it
            self.stage_s = 0.0
            self.stall_s = now - stall_from
        self.gbps = self.bytes / self.write_s / 1e9 if error is None and self.write_s > 0 else None
        self.ok = error is None
        self.error = error

    def to_json(self) -> Record:
        """The record as the JSON object of the timeline file."""
        return {
            "event": "save",
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": self.time,
            "async": self.is_async,
            "wait_s": self.wait_s,
            "stage_s": self.stage_s,
            "guard_s": self.guard_s,
            "stall_s": self.stall_s,
            "write_s": self.write_s,
            "durable_s": self.durable_s,
            "bytes": self.bytes,
            "gbps": self.gbps,
            "ok": self.ok,
            "error": self.error,
            **({} if self.tier is None else {"tier": self.tier, "replicate_s": self.replicate_s}),
            **(
                {}
                if self.written_bytes is None
                else {"written_bytes": self.written_bytes, "referenced_bytes": self.referenced_bytes}
            ),
        }


@dataclass(kw_only=True, frozen=True)
class RestoreRecord:
    """The timeline record of one successful restore (a failed restore raises, unrecorded)."""

    step: int
    rank: int
    world_size: int
    time: float
    seconds: float
    bytes: int
    sources: dict[str, int] | None = None  # two tiers: data files read per tier ("local", "replica", "persistent")
    loader_states: int | None = None  # with a dataloader: the ranks' loader states this rank read from storage

    def to_json(self) -> Record:
        """The record as the JSON object of the timeline file."""
        return {
            "event": "restore",
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": self.time,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "ok": True,
            "error": None,
            **({} if self.sources is None else {"sources": dict(self.sources)}),
            **({} if self.loader_states is None else {"loader_states": self.loader_states}),
        }


@dataclass(kw_only=True, frozen=True)
class PersistRecord:
    """The timeline record of one persist of a two-tier manager: a step copied from the
    node-local tier to the persistent one, in the background (``seconds``: this rank's copy,
    the agreement and the commit; ``bytes``: the data files this rank uploaded)."""

    step: int
    rank: int
    world_size: int
    time: float
    seconds: float
    bytes: int
    error: str | None

    def to_json(self) -> Record:
        """The record as the JSON object of the timeline file."""
        return {
            "event": "persist",
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": self.time,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "ok": self.error is None,
            "error": self.error,
        }


def timeline_target(timeline: Any, root_traits: Any) -> Any:
    """Where ``CheckpointManager(timeline=...)`` sends the timeline: ``True``, the root's
    ``TIMELINE_NAME`` when the root is a local disk that can append (a volume writes each file
    once), else memory only; ``False``/``None``: memory only; a path or a callable as given.

    Raises:
        TypeError: anything else.
    """
    if timeline is True:
        path = root_traits.local_path
        return os.path.join(path, TIMELINE_NAME) if root_traits.can_append and path else None
    if timeline is False or timeline is None:
        return None
    if callable(timeline) or isinstance(timeline, (str, os.PathLike)):
        return timeline
    raise TypeError(f"timeline must be a bool, a file path or a callable, got {type(timeline).__name__}")


class TimelineSink:
    """Where the records of one manager go: an in-memory list, plus a file or a callback."""

    def __init__(self, target: str | os.PathLike | Callable[[Record], None] | None) -> None:
        self.records: collections.deque[Record] = collections.deque(maxlen=MEMORY_RECORDS)
        self._path = None if target is None or callable(target) else os.fspath(target)
        self._callback = target if callable(target) else None

    @property
    def path(self) -> str | None:
        """The JSON-lines file the records are appended to, if any."""
        return self._path

    def emit(self, event: SaveRecord | RestoreRecord | PersistRecord) -> None:
        """Record one event. Best effort: a failure to write the timeline never fails a save."""
        record = event.to_json()
        self.records.append(record)
        if self._path is not None:
            line = (json.dumps(record, sort_keys=True) + "\n").encode()
            try:
                os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)  # one write per line: appends from ranks do not interleave
                finally:
                    os.close(fd)
            except OSError as e:
                logger.warning("could not append to the timeline %s: %s", self._path, e)
        if self._callback is not None:
            try:
                self._callback(dict(record))
            except Exception:  # noqa: BLE001 - a broken callback must not fail a save
                logger.exception("timeline callback raised")


def read_timeline(path: str | os.PathLike) -> list[Record]:
    """The records of a timeline file, in file order.

    A torn last line (a process killed mid-append) is skipped; any other line that is not a JSON
    object raises ``ValueError`` naming the line.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out: list[Record] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 1:  # the last line, possibly without its newline
                continue
            raise ValueError(f"{os.fspath(path)}:{i}: not a JSON line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{os.fspath(path)}:{i}: not a JSON object")
        out.append(record)
    return out


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "count": len(values),
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "max": max(values),
        "total": math.fsum(values),
    }


def summarize_timeline(records: Iterable[Record]) -> dict[str, Any]:
    """Aggregate a timeline: per-save stall and background time, restore time.

    The stall of a step is the slowest rank's (a collective training loop waits for it); the
    background and restore times likewise. Failed saves are counted apart.
    """
    saves: dict[int, list[Record]] = {}
    restored: list[Record] = []
    failed = 0
    for r in records:
        if r.get("event") == "save":
            if not r.get("ok", False):
                failed += 1
                continue
            saves.setdefault(int(r["step"]), []).append(r)
        elif r.get("event") == "restore" and r.get("ok", False):
            restored.append(r)
    per_step = {s: rs for s, rs in sorted(saves.items())}
    # One restore of a job = the records of its ranks: same step, started within a minute.
    restores: list[list[Record]] = []
    for r in sorted(restored, key=lambda r: (int(r["step"]), float(r["time"]))):
        last = restores[-1][0] if restores else None
        if last is not None and last["step"] == r["step"] and float(r["time"]) - float(last["time"]) < RESTORE_WINDOW_S:
            restores[-1].append(r)
        else:
            restores.append([r])
    return {
        "saves": len(per_step),
        "failed_saves": failed,
        "stall_s": _stats([max(float(r["stall_s"]) for r in rs) for rs in per_step.values()]),
        "write_s": _stats([max(float(r["write_s"]) for r in rs) for rs in per_step.values()]),
        "durable_s": _stats([max(float(r.get("durable_s", r["write_s"])) for r in rs) for rs in per_step.values()]),
        "async_saves": sum(1 for rs in per_step.values() if any(r.get("async") for r in rs)),
        "bytes_per_save": _stats([float(sum(int(r["bytes"]) for r in rs)) for rs in per_step.values()]),
        "restores": len(restores),
        "restore_s": _stats([max(float(r["seconds"]) for r in rs) for rs in restores]),
    }


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict that this rank holds: a DTensor counts its
    local shard only, a per-rank row (``dcp.rank_rows``) its own row."""
    import torch  # here, so that reading a timeline (``goodput-ckpt plan``) loads no torch

    from ..dcp.rank_rows import RankRow

    if isinstance(obj, RankRow):
        return obj.row.numel() * obj.row.element_size()
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)
        t = local if isinstance(local, torch.Tensor) else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    return 0
