"""A restore's reader threads and a save's writer threads kept from one load or save to the next
(engine/worker_pool.py) against threads started for each, as before, in one process.

The tiers model of ``bench_peers.py`` (a ``Linear`` stack plus AdamW, ``bench_stall.build``),
saved once by ``CheckpointManager``; then ``--repeats`` pairs of restores by a new manager (a
restarted job's restore, verification on), then as many pairs of synchronous saves of a new step
(``async_save=False``, ``keep_last=2``), each pair's order alternating. "fresh" makes every
pool private to its load (``WorkerPool.on_worker`` answers yes, so each load makes its own
``ThreadPoolExecutor`` and shuts it down: the code before the change); "kept" is the default.
Prints min/median/max of each and of fresh / kept within each pair, and the load average.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_reader_threads.py --size 144MiB --repeats 16``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch.distributed as dist  # noqa: E402
from bench_stall import build  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402
from goodput_ckpt.cli._output import parse_size  # noqa: E402
from goodput_ckpt.engine.worker_pool import WorkerPool  # noqa: E402


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="144MiB", help="model plus AdamW state (default 144MiB)")
    ap.add_argument("--repeats", type=int, default=16)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="probe-reader-threads-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        model, opt, *_ = build(parse_size(args.size), 8)
        root = os.path.join(tmp, "root")
        with CheckpointManager(root, keep_last=None, timeline=False, async_save=False) as mgr:
            mgr.save(1, model=model, optimizer=opt)
        kept_check = WorkerPool.on_worker
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        step = [1]

        def restore() -> float:
            with CheckpointManager(root, timeline=False) as mgr:
                t0 = time.perf_counter()
                mgr.restore(model=model, optimizer=opt)
                return time.perf_counter() - t0

        def save() -> float:
            step[0] += 1
            with CheckpointManager(root, keep_last=2, timeline=False, async_save=False) as mgr:
                t0 = time.perf_counter()
                mgr.save(step[0], model=model, optimizer=opt)
                return time.perf_counter() - t0

        for what, fn in (("restore", restore), ("save", save)):
            times: dict[str, list[float]] = {"fresh": [], "kept": []}
            for r in range(args.repeats):
                for way in ("fresh", "kept") if r % 2 == 0 else ("kept", "fresh"):
                    WorkerPool.on_worker = (lambda self: True) if way == "fresh" else kept_check
                    try:
                        times[way].append(fn())
                    finally:
                        WorkerPool.on_worker = kept_check
            ratio = [f / k for f, k in zip(times["fresh"], times["kept"])]
            print(f"{what}: order fresh, kept / kept, fresh alternating; {args.repeats} pairs")
            print(f"  {what} s, fresh threads each time: {_spread(times['fresh'])}")
            print(f"  {what} s, kept threads:            {_spread(times['kept'])}")
            print(
                f"  fresh / kept (within each pair):   {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
            )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
