"""Full garbage collections inside a save, with the cyclic collector paused around ``dcp.save``
and without, in one process (what ``CheckpointManager``'s synchronous saves now do:
manager/save_job.py ``save_now``).

The process holds 300,000 small long-lived objects (a trainer's modules, optimizer and data
structures stand in) and a 64 MiB state in 500 tensors; ``--repeats`` pairs of
``dcp.save`` through ``CheckpointWriter``, the pair's order alternating. A ``gc.callbacks``
hook counts the full (generation 2) collections that start inside each save, and those that
start during 20,000 allocations right after it (a deferred collection would land there).
Prints the counts and each way's save seconds, min/median/max.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_gc_save.py --repeats 30``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.format.gc_pause import gc_paused


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    full = [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    gc.callbacks.append(count)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(64 * 1024 * 1024 // 4 // 500, generator=g) for i in range(500)}
    long_lived = [{"a": i} for i in range(300_000)]
    tmp = tempfile.mkdtemp(prefix="probe-gc-save-")
    seconds: dict[str, list[float]] = {"paused": [], "on": []}
    inside = {"paused": 0, "on": 0}
    after = {"paused": 0, "on": 0}
    print(f"load average before: {os.getloadavg()[0]:.2f}; {len(long_lived)} long-lived objects")
    try:
        for r in range(args.repeats):
            for way in ("paused", "on") if r % 2 == 0 else ("on", "paused"):
                where = os.path.join(tmp, f"{r}-{way}")
                before = full[0]
                t0 = time.perf_counter()
                with gc_paused() if way == "paused" else contextlib.nullcontext():
                    dcp.save(state, storage_writer=CheckpointWriter(where))
                seconds[way].append(time.perf_counter() - t0)
                inside[way] += full[0] - before
                before = full[0]
                burst = [{"b": i} for i in range(20_000)]
                del burst
                after[way] += full[0] - before
                shutil.rmtree(where)
    finally:
        gc.callbacks.remove(count)
        shutil.rmtree(tmp, ignore_errors=True)
    for way, xs in seconds.items():
        print(
            f"{way:6s}: full collections inside the saves {inside[way]}, right after {after[way]}, "
            f"of {args.repeats}; save s {min(xs):.4f} / {statistics.median(xs):.4f} / {max(xs):.4f}"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
