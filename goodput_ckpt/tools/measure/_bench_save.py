"""How a benchmark times one save: the rule ``goodput-ckpt bench`` and ``benchmarks/`` share.

Every timed save comes right after an untimed **warm-up save** of the same state, by the same
method, into another location that is deleted just before the clock starts.

Why: a save writes into the page cache, and the page cache takes free memory. On a VM with free
page reporting (virtio-balloon; this project's machine has it), memory that stays free for about
2 s is handed back to the host, and touching it again costs a host page fault per page. How long
memory had sat free before a save then set the save's time, not the writer: on the 2-core
machine, 1 GiB, ``benchmarks/probe_save_conditions.py`` measured our save at a median of 0.70 s
right after the same save had been deleted and 3.44 s when the same freed memory had idled 8 s
first (torch's ``FileSystemWriter``: 1.34 and 2.54 s); the CPU time grows with it (0.7 against
2-2.3 CPU-s for ours), so the extra time is page faults, not the disk (docs/benchmarks.md).
``goodput-ckpt bench`` used to time a save right after an async save (warm memory) and
``bench_local.py`` after a cache drop and a quiet wait (cold memory): 0.77 against 1.26 s for
ours, and different ratios, because the writers absorb the faults differently.

The warm-up makes the condition the same for every method and every run, without root, and
measures what the writer and the disk cost, as on a host without free page reporting. It times the
second of two saves in quick succession, as when a training job saves periodically and the
previous checkpoint's memory is reused, not a save after an idle spell on a VM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["timed_save", "wall_seconds"]

T = TypeVar("T")


def wall_seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()``; the default clock of :func:`timed_save`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_save(
    save: Callable[[str], Any],
    target: str,
    *,
    warm: str,
    remove: Callable[[str], None],
    clock: Callable[[Callable[[], Any]], T] = wall_seconds,
) -> T:
    """Save into ``warm`` (untimed), remove it, then time a save into ``target``.

    Args:
        save: writes the state to a location and returns once it is durable (the same callable
            for both saves, so both are the same method).
        target: the location of the timed save (kept; the caller loads and removes it).
        warm: the warm-up location, a sibling of ``target``; removed before the timed save.
        remove: deletes a location and everything under it.
        clock: runs the timed save and returns its measurement (default: wall seconds); a
            benchmark that also records CPU time passes its own.

    Returns:
        What ``clock`` returned for the timed save.
    """
    save(warm)
    remove(warm)
    os.sync()  # the unlinks' metadata, so the timed save's fsyncs do not carry them
    return clock(lambda: save(target))
