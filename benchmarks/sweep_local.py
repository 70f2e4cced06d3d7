"""Sweep CheckpointWriter/CheckpointReader tuning knobs on local disk, within one run.

Writer: chunk_size, thread_count, files_per_rank (and, with ``--writeback-ab``, the local store's
early writeback on/off). Reader (cold cache, verify on): thread_count and TASK_BYTES. By default
one knob varies at a time around the library defaults (``--design oat``); ``--design grid`` runs
every combination (for the reader: for each chunk size written). Each repeat also measures the raw sequential
write+fsync and read of the same bytes, and every configuration is reported both in GB/s and
relative to the raw figure *of the same repeat*, which cancels most of the drift of a shared,
noisy machine. Configurations run round-robin, in a different order each repeat.

Uses the state, timing and cache-dropping helpers of ``bench_local.py``.

Run: ``.venv/bin/python benchmarks/sweep_local.py --size 1GiB --repeats 3 --json sweep.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_local as bl  # noqa: E402

import goodput_ckpt.dcp.reader as reader_mod  # noqa: E402
import goodput_ckpt.dcp.writer as writer_mod  # noqa: E402
import goodput_ckpt.storage.local as local_mod  # noqa: E402
from goodput_ckpt import CheckpointReader, CheckpointWriter  # noqa: E402

MiB = 1 << 20


def _ints(text: str, unit: int = 1) -> list[int]:
    return [int(float(x) * unit) for x in text.split(",") if x]


def _save(ctx: bl.Ctx, base: str, kw: dict[str, Any], quiet: float, writeback: bool = True) -> tuple[bl.Sample, str]:
    """One timed save; ``writeback=False`` disables the local store's early writeback."""
    d = tempfile.mkdtemp(prefix="ours-", dir=base)
    os.sync()
    bl.wait_quiet(quiet, ctx.dev)
    saved = getattr(local_mod, "_SYNC_FILE_RANGE", None)
    if not writeback:
        local_mod._SYNC_FILE_RANGE = None
    try:
        s, _ = bl.timed(
            lambda: (dcp.save(ctx.state.nested, storage_writer=CheckpointWriter(d, **kw)), bl.fsync_path(d))
        )
    finally:
        if not writeback:
            local_mod._SYNC_FILE_RANGE = saved
    return s, d


def _load(ctx: bl.Ctx, d: str, threads: int, task_bytes: int, quiet: float) -> bl.Sample:
    bl.wait_quiet(quiet, ctx.dev)
    bl.drop_caches()
    old = reader_mod.TASK_BYTES
    reader_mod.TASK_BYTES = task_bytes
    try:
        s, _ = bl.timed(
            lambda: dcp.load(ctx.dest, storage_reader=CheckpointReader(d, verify=True, thread_count=threads))
        )
    finally:
        reader_mod.TASK_BYTES = old
    return s


def _raw(ctx: bl.Ctx, base: str, quiet: float) -> tuple[bl.Sample, bl.Sample]:
    d = tempfile.mkdtemp(prefix="raw-", dir=base)
    try:
        os.sync()
        bl.wait_quiet(quiet, ctx.dev)
        w, _ = bl.timed(lambda: (bl._raw_save(ctx, d), bl.fsync_path(d)))
        bl.wait_quiet(quiet, ctx.dev)
        bl.drop_caches()
        r, _ = bl.timed(lambda: bl._raw_read(ctx, d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        os.sync()
    return w, r


def _summary(nbytes: int, samples: list[tuple[bl.Sample, float]]) -> dict[str, Any]:
    walls = [s.wall for s, _ in samples]
    rel = [raw / s.wall for s, raw in samples]  # throughput relative to raw, same repeat
    return {
        "seconds": [round(w, 4) for w in walls],
        "other_cpus": [round(s.other, 2) for s, _ in samples],
        "gbps": nbytes / statistics.median(walls) / bl.GB,
        "best_gbps": nbytes / min(walls) / bl.GB,
        "vs_raw": statistics.median(rel),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-mib", default="4,8,16", help="writer chunk sizes in MiB")
    p.add_argument("--write-threads", default="2,4,8")
    p.add_argument("--files-per-rank", default="1,2")
    p.add_argument("--read-threads", default="4,8,16")
    p.add_argument("--task-mib", default="8,16,32,64", help="reader TASK_BYTES in MiB (at least one chunk)")
    p.add_argument(
        "--writeback-ab",
        action="store_true",
        help="also run every writer configuration with the local store's early writeback (sync_file_range) disabled",
    )
    p.add_argument(
        "--design",
        choices=("oat", "grid"),
        default="oat",
        help="oat: vary one knob at a time around the library defaults; grid: every combination",
    )
    p.add_argument("--skip-writer", action="store_true")
    p.add_argument("--skip-reader", action="store_true")
    p.add_argument("--quiet", type=float, default=10.0, help="see bench_local.py --quiet")
    a = p.parse_args(argv)

    state = bl.make_state(bl.parse_size(a.size), a.seed)
    base = tempfile.mkdtemp(prefix="goodput-sweep-", dir=a.dir)
    ctx = bl.Ctx(
        state,
        bl.empty_like_nested(state.nested),
        torch.zeros(state.nbytes, dtype=torch.uint8),
        dev=os.stat(base).st_dev,
    )
    chunks = _ints(a.chunk_mib, MiB)
    wbs = (True, False) if a.writeback_ab else (True,)
    if a.design == "grid":
        wconfigs = list(itertools.product(chunks, _ints(a.write_threads), _ints(a.files_per_rank), wbs))
        rconfigs = [
            (c, t, tb) for c in chunks for t in _ints(a.read_threads) for tb in _ints(a.task_mib, MiB) if tb >= c
        ]
    else:
        # One knob at a time around the library defaults: fewer configurations, so more repeats
        # fit in the quiet spells of a shared machine.
        bc, bt, bf = writer_mod.DEFAULT_CHUNK_SIZE, writer_mod.DEFAULT_WRITE_THREADS, 1
        rt, rtb = reader_mod.DEFAULT_READ_THREADS, reader_mod.TASK_BYTES
        wset = {(c, bt, bf, True) for c in chunks} | {(bc, t, bf, True) for t in _ints(a.write_threads)}
        wset |= {(bc, bt, f, True) for f in _ints(a.files_per_rank)} | {(bc, bt, bf, wb) for wb in wbs}
        wconfigs = sorted(wset)
        rset = {(bc, t, rtb) for t in _ints(a.read_threads)} | {
            (bc, rt, tb) for tb in _ints(a.task_mib, MiB) if tb >= bc
        }
        rconfigs = sorted(rset)
        chunks = [bc]
    print(
        f"state {state.nbytes / (1 << 30):.2f} GiB, {len(state.flat)} tensors; {len(wconfigs)} writer and "
        f"{len(rconfigs)} reader configurations x {a.repeats} repeats; under {base}"
    )
    wsamples: dict[tuple, list[tuple[bl.Sample, float]]] = {c: [] for c in wconfigs}
    rsamples: dict[tuple, list[tuple[bl.Sample, float]]] = {c: [] for c in rconfigs}
    raw_w: list[bl.Sample] = []
    raw_r: list[bl.Sample] = []
    rng = random.Random(a.seed)
    t_start = time.perf_counter()
    try:
        for rep in range(a.repeats):
            w, r = _raw(ctx, base, a.quiet)
            raw_w.append(w)
            raw_r.append(r)
            print(
                f"repeat {rep + 1}: raw write {state.nbytes / w.wall / bl.GB:.3f} GB/s, "
                f"read {state.nbytes / r.wall / bl.GB:.3f} GB/s"
            )
            if not a.skip_writer:
                order = wconfigs[:]
                rng.shuffle(order)
                for c, t, f, wb in order:
                    s, d = _save(ctx, base, {"chunk_size": c, "thread_count": t, "files_per_rank": f}, a.quiet, wb)
                    shutil.rmtree(d, ignore_errors=True)
                    os.sync()
                    wsamples[(c, t, f, wb)].append((s, w.wall))
            if not a.skip_reader:
                for c in chunks:
                    s, d = _save(ctx, base, {"chunk_size": c}, a.quiet)
                    order = [rc for rc in rconfigs if rc[0] == c]
                    rng.shuffle(order)
                    for _, t, tb in order:
                        rsamples[(c, t, tb)].append((_load(ctx, d, t, tb, a.quiet), r.wall))
                    shutil.rmtree(d, ignore_errors=True)
                    os.sync()
            print(f"  repeat {rep + 1} done at {time.perf_counter() - t_start:.0f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    n = state.nbytes
    report: dict[str, Any] = {
        "size": n,
        "repeats": a.repeats,
        "raw_write_gbps": n / statistics.median(s.wall for s in raw_w) / bl.GB,
        "raw_read_gbps": n / statistics.median(s.wall for s in raw_r) / bl.GB,
        "writer": [],
        "reader": [],
    }
    print(
        f"\nraw write+fsync {report['raw_write_gbps']:.3f} GB/s, raw read {report['raw_read_gbps']:.3f} GB/s "
        f"(medians); vs_raw = median over repeats of (config GB/s / raw GB/s of that repeat)"
    )
    if wsamples and not a.skip_writer:
        print(
            f"\n{'chunk MiB':>9}{'threads':>8}{'files':>6}{'wback':>6}{'GB/s':>8}{'best':>8}{'vs raw':>8}  others (CPUs)"
        )
        for (c, t, f, wb), ss in sorted(wsamples.items(), key=lambda kv: -_summary(n, kv[1])["vs_raw"]):
            sm = _summary(n, ss)
            report["writer"].append(
                {"chunk_size": c, "thread_count": t, "files_per_rank": f, "early_writeback": wb, **sm}
            )
            print(
                f"{c // MiB:>9}{t:>8}{f:>6}{'on' if wb else 'off':>6}{sm['gbps']:>8.3f}{sm['best_gbps']:>8.3f}"
                f"{sm['vs_raw']:>8.2f}  {sm['other_cpus']}"
            )
    if rsamples and not a.skip_reader:
        print(f"\n{'chunk MiB':>9}{'threads':>8}{'task MiB':>9}{'GB/s':>8}{'best':>8}{'vs raw':>8}  others (CPUs)")
        for (c, t, tb), ss in sorted(rsamples.items(), key=lambda kv: -_summary(n, kv[1])["vs_raw"]):
            sm = _summary(n, ss)
            report["reader"].append({"chunk_size": c, "thread_count": t, "task_bytes": tb, **sm})
            print(
                f"{c // MiB:>9}{t:>8}{tb // MiB:>9}{sm['gbps']:>8.3f}{sm['best_gbps']:>8.3f}{sm['vs_raw']:>8.2f}  {sm['other_cpus']}"
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
