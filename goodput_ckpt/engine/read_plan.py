"""Turning a DCP load plan into a few large, verified reads.

Each item the plan needs becomes a *request*: a byte range of a data file and a CPU buffer to
land it in, either the destination tensor itself (zero copy) or a staging buffer that is copied
into the destination afterwards. Requests are sorted per file and merged into *windows*:
when verifying, a window is expanded to whole hash chunks so every byte read is checked; small
gaps between neighbours are read through rather than paid for with another request. Windows are
then cut at chunk boundaries into tasks of about ``task_bytes`` for the thread pool.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request", "Task", "plan_tasks", "sequential_lanes"]

#: Gaps below this are read through instead of starting a new request.
COALESCE_GAP = 1 << 20


@dataclass(eq=False)
class Request:
    """Bytes ``[start, end)`` of ``file``, for one read item."""

    file: str
    start: int
    end: int
    item: Any  # the DCP ReadItem and how to finish it (reader-defined)
    buffer: memoryview | None = None  # set before the read; None means allocate lazily
    pending: int = 0  # tasks still to complete


@dataclass(eq=False)
class Part:
    """A piece of a task: ``[start, end)`` of the file, landing in ``request`` (None: scratch)."""

    start: int
    end: int
    request: Request | None


@dataclass(eq=False)
class Task:
    file: str
    start: int
    end: int
    parts: list[Part] = field(default_factory=list)


def _batches(requests: list[Request]) -> list[list[Request]]:
    """Split requests of one file into batches without overlapping ranges (overlaps are rare:
    two destination shards needing the same stored bytes)."""
    batches: list[list[Request]] = []
    ends: list[int] = []
    for r in sorted(requests, key=lambda r: (r.start, r.end)):
        for b, end in enumerate(ends):
            if r.start >= end:
                batches[b].append(r)
                ends[b] = max(end, r.end)
                break
        else:
            batches.append([r])
            ends.append(r.end)
    return batches


def plan_tasks(
    requests: list[Request],
    *,
    chunk_size: int,
    verify: bool,
    file_sizes: dict[str, int],
    task_bytes: int,
    unverified: Collection[str] = frozenset(),
) -> list[Task]:
    """Group ``requests`` into read tasks (see module docstring). Sets ``Request.pending``.
    ``unverified``: files read as if ``verify`` were false (their chunks were already checked)."""
    by_file: dict[str, list[Request]] = {}
    for r in requests:
        if r.end > r.start:
            by_file.setdefault(r.file, []).append(r)
    task_chunks = max(1, task_bytes // chunk_size)
    tasks: list[Task] = []
    for file, reqs in sorted(by_file.items()):
        size = file_sizes[file]
        verify_file = verify and file not in unverified
        for batch in _batches(reqs):
            # Windows: [lo, hi) ranges to read, each with its requests.
            windows: list[tuple[int, int, list[Request]]] = []
            for r in batch:
                lo, hi = r.start, r.end
                if verify_file:
                    lo = lo // chunk_size * chunk_size
                    hi = min(size, math.ceil(hi / chunk_size) * chunk_size)
                if windows and lo <= windows[-1][1] + (0 if verify_file else COALESCE_GAP):
                    w = windows[-1]
                    windows[-1] = (w[0], max(w[1], hi), w[2] + [r])
                else:
                    windows.append((lo, hi, [r]))
            for lo, hi, wreqs in windows:
                step = task_chunks * chunk_size
                cut = lo
                while cut < hi:
                    # Task boundaries fall on chunk boundaries, so no chunk is split across tasks.
                    nxt = (
                        min(hi, (cut // chunk_size + task_chunks) * chunk_size) if verify_file else min(hi, cut + step)
                    )
                    tasks.append(_make_task(file, cut, nxt, wreqs))
                    cut = nxt
    return tasks


def _make_task(file: str, lo: int, hi: int, reqs: list[Request]) -> Task:
    task = Task(file, lo, hi)
    pos = lo
    for r in reqs:
        s, e = max(lo, r.start), min(hi, r.end)
        if s >= e:
            continue
        if s > pos:
            task.parts.append(Part(pos, s, None))
        task.parts.append(Part(s, e, r))
        r.pending += 1
        pos = e
    if pos < hi:
        task.parts.append(Part(pos, hi, None))
    return task


#: Most concurrent runs (streams) per file in :func:`sequential_lanes`. On FUSE mounts one stream
#: per file wins when there are several files and two win on a single file, while many lose
#: everywhere (docs/benchmarks.md, "Defaults").
MAX_RUNS_PER_FILE = 2


def sequential_lanes(tasks: list[Task], threads: int) -> list[list[Task]]:
    """Group ``tasks`` (in ``plan_tasks`` order: by file, then offset) into runs, each within
    one file and read in order by one thread.

    For stores that stream a file better than they serve scattered ranges (a FUSE mount reads
    ahead within one descriptor; an object-store mount turns a seek into a new request). Every
    file is one run, and so one stream, while the plan touches at least ``threads // 2`` files;
    with fewer files each is cut into up to :data:`MAX_RUNS_PER_FILE` runs of about equal bytes,
    so that a load of one or two files still has a few streams.
    """
    by_file: dict[str, list[Task]] = {}
    for t in tasks:
        by_file.setdefault(t.file, []).append(t)
    want = max(1, threads // 2)
    per_file = max(1, min(MAX_RUNS_PER_FILE, -(-want // max(1, len(by_file)))))
    out: list[list[Task]] = []
    for file_tasks in by_file.values():
        target = -(-sum(t.end - t.start for t in file_tasks) // per_file)
        run: list[Task] = []
        run_bytes = 0
        for t in file_tasks:
            if run and run_bytes >= target:
                out.append(run)
                run, run_bytes = [], 0
            run.append(t)
            run_bytes += t.end - t.start
        out.append(run)
    return out
