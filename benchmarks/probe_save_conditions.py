"""Which condition makes a local save fast or slow (issue 21: `goodput-ckpt bench` against bench_local.py).

Each repeat times one synchronous ``dcp.save`` per (method, condition), in rotating order, into a
new directory under ``--dir``; the condition is what happened just before the clock started:

- ``after-async``: a ``dcp.async_save`` of the same state to another directory, waited for and
  deleted (what ``goodput-ckpt bench`` did before its timed save);
- ``after-save``: a synchronous save of the same state, deleted (freshly freed memory, no async);
- ``after-save-idle``: as ``after-save``, then ``--idle`` seconds asleep (the same freed memory,
  given time to be reported back to the host: free page reporting waits about 2 s);
- ``idle``: ``os.sync()`` then ``--idle`` seconds asleep (memory freed earlier has had time to
  be reported back to the host; what bench_local.py's quiet wait and cache drop give);
- ``dropped``: ``drop_caches`` then ``--idle`` seconds asleep.

Prints min/median/max seconds per cell, the order, the load average, and the median per-repeat
ratio ours/torch per condition.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.cli._output import parse_size
from goodput_ckpt.tools.measure._bench_state import make_state

warnings.filterwarnings("ignore")


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


WRITERS = {"ours": lambda d: CheckpointWriter(d), "torch": lambda d: dcp.FileSystemWriter(d, thread_count=1)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=os.getcwd())
    p.add_argument("--idle", type=float, default=8.0)
    p.add_argument("--conditions", default="after-async,after-save,idle,dropped")
    a = p.parse_args()
    state = make_state(parse_size(a.size), 0)
    base = tempfile.mkdtemp(prefix="goodput-probe-", dir=a.dir)
    conds = a.conditions.split(",")
    cells = [(m, c) for c in conds for m in WRITERS]
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cells}
    load0 = os.getloadavg()
    orders = []
    n = 0
    try:
        for rep in range(a.repeats):
            k = rep % len(cells)
            order = cells[k:] + cells[:k]
            orders.append(order)
            for m, c in order:
                n += 1
                pre = os.path.join(base, f"pre-{n}")
                d = os.path.join(base, f"t-{n}")
                if c == "after-async":
                    w = WRITERS[m](pre)
                    dcp.async_save(state.nested, storage_writer=w, no_dist=True).result()
                    del w
                    shutil.rmtree(pre)
                elif c == "after-save":
                    dcp.save(state.nested, storage_writer=WRITERS[m](pre), no_dist=True)
                    shutil.rmtree(pre)
                elif c == "after-save-idle":
                    dcp.save(state.nested, storage_writer=WRITERS[m](pre), no_dist=True)
                    shutil.rmtree(pre)
                    os.sync()
                    time.sleep(a.idle)
                elif c == "idle":
                    os.sync()
                    time.sleep(a.idle)
                elif c == "dropped":
                    drop_caches()
                    time.sleep(a.idle)
                t0 = time.perf_counter()
                c0 = time.process_time()
                dcp.save(state.nested, storage_writer=WRITERS[m](d), no_dist=True)
                t = time.perf_counter() - t0
                times[(m, c)].append(t)
                print(f"rep {rep + 1} {m:<6} {c:<12} {t:6.3f} s  cpu {time.process_time() - c0:5.2f}", flush=True)
                shutil.rmtree(d)
                os.sync()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{state.nbytes / 2**30:.2f} GiB, {a.repeats} repeats; load average {load0} -> {os.getloadavg()}")
    print("order: " + " | ".join(", ".join(f"{m}/{c}" for m, c in o) for o in orders))
    for c in conds:
        o, t = times[("ours", c)], times[("torch", c)]
        r = [y / x for x, y in zip(o, t)]
        print(
            f"{c:<12} ours {min(o):.2f}/{statistics.median(o):.2f}/{max(o):.2f} s  "
            f"torch {min(t):.2f}/{statistics.median(t):.2f}/{max(t):.2f} s  "
            f"ratio {min(r):.2f}/{statistics.median(r):.2f}/{max(r):.2f}x (min/median/max)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
