"""The cyclic GC pause around the commit record (format/gc_pause.py), on and off in one process.

The 70B training state at 1,024 ranks (bench_scale's compact simulation, ``--state training``):
build, serialize and parse, 5 repeats each with the pause and with it disabled (``gc.disable``
made a no-op), alternating; a collection deferred past the pause is counted (allocations after
each phase). Prints the order and median (min-max) per phase.

Run: ``flock /tmp/bench.lock env PYTHONPATH=. .venv/bin/python benchmarks/probe_gc_pause.py``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_scale import simulate_compact  # noqa: E402

from goodput_ckpt.dcp.commit_build import build_manifest, forget_layouts  # noqa: E402
from goodput_ckpt.format.manifest import parse_manifest  # noqa: E402

PHASES = ("build", "serialize", "parse")


def _allocate() -> None:
    """Allocations after a phase: a collection the pause deferred runs here, inside the timing."""
    [object() for _ in range(1000)]


def one_pass(sim) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    forget_layouts()
    t0 = time.perf_counter()
    m = build_manifest(sim.metadata, sim.results, chunk_size=8 << 20, created_at="", user_metadata={}, version=2)
    _allocate()
    t1 = time.perf_counter()
    data = m.to_json()
    _allocate()
    t2 = time.perf_counter()
    parse_manifest(data)
    _allocate()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main() -> int:
    sim = simulate_compact("70B", 1024, 1, "training")
    disable = gc.disable
    res: dict[str, list[tuple[float, float, float]]] = {"paused": [], "not paused": []}
    order = []
    for i in range(10):
        mode = "paused" if i % 2 == 0 else "not paused"
        order.append(mode[0])
        if mode == "not paused":
            gc.disable = lambda: None  # gc_paused then leaves the collector on
        try:
            res[mode].append(one_pass(sim))
        finally:
            gc.disable = disable
    print("order", "".join(order), f"load average {os.getloadavg()[0]:.2f}")
    for mode, runs in res.items():
        cells = []
        for j, name in enumerate(PHASES):
            xs = [r[j] for r in runs]
            cells.append(f"{name} {statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        print(mode, " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
