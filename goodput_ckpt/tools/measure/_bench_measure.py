"""The measurement procedure ``goodput-ckpt bench`` and ``benchmarks/bench_local.py`` share.

One implementation of every step that decides what a figure means, so that the same methods give
the same ratios in both tools (issue 21). Before it, the two timed the same writers on the same
state but differed in what came before each timed save (an async save with its staging copy in
the command, a quiet wait in the script), in how the page cache was emptied before a load (the
checkpoint's files with ``posix_fadvise`` in the command, ``drop_caches`` of the whole machine in
the script) and in how a ratio was formed (of medians in the command, per repeat in the docs).

The procedure, per repeat (:func:`run_rotation`) and per method (:func:`save_and_load`):

1. the order of the methods rotates by one per repeat (``a b c``, ``b c a``, ``c a b``; with two
   methods it alternates), so no method always follows the same one;
2. wait up to ``quiet`` seconds for other processes to leave the CPUs (and the disk) idle
   (:func:`wait_quiet`; the machine is shared);
3. the timed save, after an untimed warm-up save deleted just before the clock
   (:func:`._bench_save.timed_save`);
4. for each load of the method, in order: wait for quiet, evict the checkpoint's files from the
   page cache (the caller's ``evict``: ``posix_fadvise``, no root, nothing else's cache), time the
   load, then run its untimed ``after`` (check the values, reset the destination);
5. delete the checkpoint and ``sync``.

Each timed step records wall seconds, this process's CPU seconds and how many CPUs other
processes kept busy meanwhile (:class:`Sample`). A ratio between two methods is formed per repeat
(the two samples of the same repeat, which ran minutes apart at most under the same conditions)
and reported as min / median / max over the repeats (:func:`ratio_spread`), next to the ratio
of the medians.

Anything a tool measures besides (the command's async-save stall) runs in a pass of its own,
after every save and load, so that it precedes no timed save.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._bench_save import timed_save

__all__ = [
    "DEFAULT_QUIET",
    "Load",
    "RatioSpread",
    "Sample",
    "SaveLoad",
    "measure",
    "ratio_spread",
    "rotated",
    "run_rotation",
    "save_and_load",
    "spread_of",
    "wait_quiet",
]

#: Seconds each step waits at most for a quiet machine; the same default in both tools.
DEFAULT_QUIET = 10.0

try:
    _TICK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # not Linux: no /proc/stat either
    _TICK = 100


@dataclass(frozen=True)
class Sample:
    """One timed step.

    Attributes:
        wall: wall seconds (every figure and ratio is made from these).
        cpu: this process's CPU seconds (all its threads).
        other: CPUs other processes kept busy during the step, on average (a noise gauge;
            0 where ``/proc/stat`` is missing).
    """

    wall: float
    cpu: float
    other: float


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all CPUs, from ``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / _TICK  # minus idle and iowait


def _disk_busy_seconds(dev: int | None) -> float | None:
    """Seconds the block device ``dev`` (an ``st_dev``) has been busy (``/proc/diskstats`` io_ticks)."""
    if dev is None:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if int(v[0]) == os.major(dev) and int(v[1]) == os.minor(dev):
                    return int(v[12]) / 1000
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure(fn: Callable[[], Any]) -> tuple[Sample, Any]:
    """Run ``fn()`` and return its :class:`Sample` and its result."""
    b0, c0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    b1 = _busy_seconds()
    other = max(0.0, (b1 - b0 - cpu) / wall) if b0 is not None and b1 is not None and wall > 0 else 0.0
    return Sample(wall, cpu, other), out


def wait_quiet(
    max_wait: float,
    dev: int | None = None,
    *,
    cpu_threshold: float = 0.25,
    disk_threshold: float = 0.10,
    window: float = 0.5,
) -> float:
    """Wait until other processes use under ``cpu_threshold`` CPUs and keep the disk ``dev``
    busy under ``disk_threshold`` of the time, over ``window`` seconds, or ``max_wait`` passed.

    The machine may be shared: a neighbour's job can halve a measurement's throughput. This
    process is idle while it waits, so what it sees is someone else's. Returns the seconds
    waited (at least ``max_wait``: it gave up and the step measures anyway); 0 at once when
    ``max_wait`` is 0 or the machine has no ``/proc/stat``.
    """
    t0 = time.perf_counter()
    while max_wait > 0:
        b0, c0, w0, d0 = _busy_seconds(), time.process_time(), time.perf_counter(), _disk_busy_seconds(dev)
        if b0 is None:
            return 0.0
        time.sleep(window)
        dt = time.perf_counter() - w0
        b1, d1 = _busy_seconds(), _disk_busy_seconds(dev)
        other = (b1 - b0 - (time.process_time() - c0)) / dt if b1 is not None else 0.0
        disk = (d1 - d0) / dt if d0 is not None and d1 is not None else 0.0
        waited = time.perf_counter() - t0
        if (other < cpu_threshold and disk < disk_threshold) or waited >= max_wait:
            return waited
    return 0.0


def rotated(names: Sequence[str], rep: int) -> list[str]:
    """The order of ``names`` in repeat ``rep`` (0-based): rotated left by ``rep``."""
    if not names:
        return []
    k = rep % len(names)
    return list(names[k:]) + list(names[:k])


def run_rotation(names: Sequence[str], repeats: int, one: Callable[[str, int], None]) -> list[list[str]]:
    """Call ``one(name, rep)`` for every repeat and name, in :func:`rotated` order; returns the orders."""
    order = []
    for rep in range(repeats):
        order.append(rotated(names, rep))
        for name in order[-1]:
            one(name, rep)
    return order


@dataclass(frozen=True)
class Load:
    """One timed read of a saved checkpoint.

    Attributes:
        name: what the sample is called (``ours``, ``ours-noverify``, ``verify``...).
        run: location -> what it loaded (timed).
        after: untimed, with ``run``'s result: check it, reset the destination.
    """

    name: str
    run: Callable[[str], Any]
    after: Callable[[Any], None] | None = None


@dataclass
class SaveLoad:
    """What :func:`save_and_load` measured for one method in one repeat."""

    save: Sample
    loads: dict[str, Sample] = field(default_factory=dict)
    cold: list[bool | None] = field(default_factory=list)  # ``evict``'s answer before each load


def save_and_load(
    save: Callable[[str], Any],
    loads: Sequence[Load],
    *,
    target: str,
    warm: str,
    remove: Callable[[str], None],
    evict: Callable[[str], bool | None],
    quiet: float = DEFAULT_QUIET,
    dev: int | None = None,
    keep: bool = False,
    between: Callable[[str], None] | None = None,
) -> SaveLoad:
    """One method, one repeat: steps 2-5 of the module docstring.

    Args:
        save: location -> returns once the state is durable there.
        loads: the timed reads of the saved checkpoint, in order.
        target, warm: the timed save's location and the warm-up's (siblings).
        remove: deletes a location and everything under it (a warm-up location left by a
            failed warm-up save is the caller's to remove).
        evict: makes the next read of a location come from storage; returns True when done,
            False when it could not, ``None`` where it does not apply (remote storage).
        quiet: seconds to wait at most for a quiet machine before the save and each load.
        dev: the ``st_dev`` of local storage, whose busy time :func:`wait_quiet` also watches.
        keep: leave the checkpoint at ``target`` (the caller removes it).
        between: untimed, after the save and before the loads (e.g. record the files written).

    Returns:
        A :class:`SaveLoad`.
    """
    wait_quiet(quiet, dev)
    try:
        out = SaveLoad(timed_save(save, target, warm=warm, remove=remove, clock=lambda fn: measure(fn)[0]))
        if between is not None:
            between(target)
        for load in loads:
            wait_quiet(quiet, dev)
            out.cold.append(evict(target))
            sample, got = measure(lambda load=load: load.run(target))
            out.loads[load.name] = sample
            if load.after is not None:
                load.after(got)
            del got
    finally:
        if not keep:
            remove(target)
        os.sync()
    return out


@dataclass(frozen=True)
class RatioSpread:
    """A ratio of two methods' times, ``base / other`` (above 1: ``other`` is faster).

    Attributes:
        per_repeat: one ratio per repeat, from the two samples of that repeat.
        min, median, max: of ``per_repeat``.
        of_medians: ``median(base) / median(other)``.
    """

    per_repeat: tuple[float, ...]
    min: float
    median: float
    max: float
    of_medians: float

    def text(self) -> str:
        """``min / median / max`` of the per-repeat ratios, e.g. ``1.30 / 1.81 / 2.12x``."""
        return f"{self.min:.2f} / {self.median:.2f} / {self.max:.2f}x"


def spread_of(values: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "all"}`` of one figure's values over the repeats: the spread a
    benchmark reports and writes to its JSON, in one shape for every benchmark.

    Raises:
        ValueError: ``values`` is empty (a figure with no repeat has no spread).
    """
    xs = list(values)
    if not xs:
        raise ValueError("no values: a spread needs at least one repeat")
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def ratio_spread(other_s: Sequence[float], base_s: Sequence[float]) -> RatioSpread | None:
    """How much faster ``other`` is than ``base``, from their seconds in the same repeats.

    Args:
        other_s, base_s: seconds per repeat, the i-th of each from the same repeat.

    Returns:
        The :class:`RatioSpread`, or ``None`` when either is empty or a time is not positive.

    Raises:
        ValueError: the two have different numbers of repeats (not from the same run).
    """
    if len(other_s) != len(base_s):
        raise ValueError(f"per-repeat ratios need the same repeats: {len(other_s)} against {len(base_s)} samples")
    if not other_s or min(other_s) <= 0 or min(base_s) <= 0:
        return None
    per = tuple(b / o for o, b in zip(other_s, base_s))
    return RatioSpread(
        per, min(per), statistics.median(per), max(per), statistics.median(base_s) / statistics.median(other_s)
    )
