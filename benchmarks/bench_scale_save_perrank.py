"""The coordinator's per-rank work in a later save at a large W, on the real functions, without
simulating W ranks' plans (``bench_scale_save.py`` cannot reach W = 16,384 in one process: its
first save runs torch's planning over every rank's items).

What it times, each once (CPU seconds, collector off):

- the gather's unpickling of W digest-only local plans (what ``SavePlanCache`` sends from the
  second save on), and the plan cache's global step checking W digests;
- ``CheckpointWriter.prepare_global_plan`` over W plans (W assignments with a held layout
  each: here none is held, which costs the same per rank), and the scatter's pickling of them;
- the gather's unpickling of W rank reports without rows: one file a rank with one 64-hex-digit
  hash per 8 MiB of its share of a 70B + AdamW state (700 GB), as ``bench_scale_save`` makes them.

Not timed here: the commit record's build, serialization and self-check at W (docs/scale.md,
schema 2 sections, 0.41-0.43 s at 16,384 ranks), and the coordinator's own local plan and write
bookkeeping (flat in W: ``bench_scale_save.py``).

Run: ``python benchmarks/bench_scale_save_perrank.py --ranks 256,16384``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.dcp.plan_cache import PlanDigest, SavePlanCache
from goodput_ckpt.dcp.rank_reports import RANK_WRITES_KEY, RankReport
from goodput_ckpt.format.manifest import FileEntry

CHUNK = 8 << 20
STATE_BYTES = 700e9  # 70B parameters in bfloat16 plus AdamW's two float32 moments


def _timed(name: str, fn: Callable[[], Any], out: dict[str, float]) -> Any:
    c0 = time.process_time()
    value = fn()
    out[name] = time.process_time() - c0
    return value


def _report(rank: int, world: int) -> list[WriteResult]:
    size = int(STATE_BYTES / world)
    entry = FileEntry(
        f"rank{rank:05d}-0-abcdef123456.bin", size, tuple(f"{i:064x}" for i in range(math.ceil(size / CHUNK)))
    )
    report = RankReport((entry,), rank.to_bytes(16, "little"), None)
    return [WriteResult(index=MetadataIndex(RANK_WRITES_KEY), size_in_bytes=size, storage_data=report)]


def measure(world: int) -> dict[str, float]:
    out: dict[str, float] = {}
    digests = [r.to_bytes(16, "little") for r in range(world)]
    cache = SavePlanCache()
    # A first exchange (full, here empty, plans) leaves the coordinator's cache as a first save does.
    first = [SavePlan([], storage_data=PlanDigest(d)) for d in digests]
    scatter, _ = cache.global_plan(first, lambda plans: (plans, Metadata({})))
    cache.final_plan(scatter[0])
    blobs = [pickle.dumps(SavePlan([], usable=False, storage_data=PlanDigest(d))) for d in digests]
    gc.disable()
    try:
        sent = _timed("gather: unpickle W digest plans", lambda: [pickle.loads(b) for b in blobs], out)
        scatter, _ = _timed("plan cache: global step over W digests", lambda: cache.global_plan(sent, None), out)
        with tempfile.TemporaryDirectory(prefix="bench-perrank-") as root:
            writer = CheckpointWriter(root)
            final = _timed("writer.prepare_global_plan", lambda: writer.prepare_global_plan(scatter), out)
        _timed("scatter: pickle W plans", lambda: [pickle.dumps(p) for p in final], out)
        reports = [pickle.dumps(_report(r, world)) for r in range(world)]
        out["reports gathered (bytes)"] = sum(map(len, reports))
        _timed("gather: unpickle W rank reports", lambda: [pickle.loads(b) for b in reports], out)
    finally:
        gc.enable()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="256,16384")
    args = ap.parse_args(argv)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for world in (int(w) for w in args.ranks.split(",")):
        out = measure(world)
        total = sum(v for k, v in out.items() if "bytes" not in k)
        print(f"W={world}: per-rank work of a later save on the coordinator, CPU s (total {total:.3f})")
        for k, v in out.items():
            print(f"  {k:<45} {v:,.3f}" if "bytes" not in k else f"  {k:<45} {int(v):,}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
