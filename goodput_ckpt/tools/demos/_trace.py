"""What a demo launch printed and how a checkpointed run's wall time splits.

Rank 0 of the demo job (:mod:`._demo_job`) prints one line per event (``READY``, ``RESTORED``,
``STEP``, ``SAVED``, ``SYNC``, ``DONE``); a :class:`Trace` collects them, and :func:`account`
turns the traces of the reference run and of the killed and restarted launches into the
report's time split and goodput (the definitions are in ``tools/demos/demo.py``'s docstring).
Shared by the one-tier and the two-tier demos; apart from reading the timeline
(:func:`in_flight_at_kill`) it is pure, so the tests feed it traces directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trace", "account", "first_step_start", "in_flight_at_kill", "parse_line", "span"]


@dataclass
class Trace:
    """What rank 0 printed during one launch."""

    ready: float | None = None
    restored: int | None = None
    restored_at: float | None = None
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (end time, seconds)
    saves: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (end time, stall)
    sync_s: float | None = None
    done: float | None = None


def parse_line(trace: Trace, line: str) -> None:
    """Record one line rank 0 printed; raises ``ValueError``/``IndexError`` on a line not ours."""
    word, *rest = line.split()
    if word == "READY":
        trace.ready = float(rest[0])
    elif word == "RESTORED":
        trace.restored = None if rest[0] == "none" else int(rest[0])
        trace.restored_at = float(rest[1])
    elif word == "STEP":
        trace.steps[int(rest[0])] = (float(rest[1]), float(rest[2]))
    elif word == "SAVED":
        trace.saves[int(rest[0])] = (float(rest[1]), float(rest[2]))
    elif word == "SYNC":
        trace.sync_s = float(rest[0])
    elif word == "DONE":
        trace.done = float(rest[0])


def in_flight_at_kill(first: Trace, timeline: str, killed_at: float) -> int | None:
    """The newest save the first launch handed off whose commit was not recorded before the kill
    (the restart saves some of the same steps again)."""
    from ...manager.timeline import read_timeline

    records = read_timeline(timeline)
    committed = {r["step"] for r in records if r["event"] == "save" and r["ok"] and r["time"] < killed_at}
    return max((s for s in first.saves if s not in committed), default=None)


def first_step_start(trace: Trace) -> float:
    end, seconds = trace.steps[min(trace.steps)]
    return end - seconds


def span(trace: Trace) -> float:
    """Wall time from the start of the first step to the end of the last one."""
    return max(t for t, _ in trace.steps.values()) - first_step_start(trace)


def account(ref: Trace, first: Trace, second: Trace, killed_at: float) -> dict[str, Any]:
    """Split the checkpointed run's wall time into the parts that ``tools/demos/demo.py``'s
    docstring defines (total, training, stall, lost, restart, restore, other) and the goodput
    with our saves and with synchronous ones (:data:`~.results.SYNC_BASIS`)."""
    restored = second.restored
    if restored is None or restored not in first.steps:
        raise RuntimeError(f"the restart restored {restored!r}, not a step the first launch completed")
    stalls = {s: v[1] for s, v in first.saves.items() if s <= restored} | {s: v[1] for s, v in second.saves.items()}
    seconds = {
        "total": max(t for t, _ in second.steps.values()) - first_step_start(first),
        "training": span(ref),
        "stall": sum(stalls.values()),
        "lost": killed_at - first.steps[restored][0],
        "restart": (second.ready or killed_at) - killed_at,
        "restore": (second.restored_at or 0.0) - (second.ready or killed_at),
    }
    seconds["other"] = seconds["total"] - sum(v for k, v in seconds.items() if k != "total")
    sync_s = second.sync_s if second.sync_s is not None else float("nan")
    # The same run, each kept save's stall replaced by a blocking save; all else charged to both.
    total_sync = seconds["total"] - seconds["stall"] + len(stalls) * sync_s
    return {
        "seconds": seconds,
        "goodput": seconds["training"] / seconds["total"],
        "sync_save_s": sync_s,
        "saves_kept": len(stalls),
        "goodput_sync": seconds["training"] / total_sync,
        "stall_per_save_s": seconds["stall"] / max(1, len(stalls)),
    }
