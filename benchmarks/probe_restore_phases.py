"""Where a manager restore's time goes, phase by phase (issue 38), in ``bench_peers.py --targets
tiers``' setting: its model and AdamW state, a one-rank gloo group, a manager made before the clock.

Each phase is a function of the restore path wrapped with ``time.perf_counter`` and
``time.thread_time`` (the CPU of the thread that called it; the reader threads' hashing and reads
show only in the process CPU, ``TOTAL process cpu``). Phases nest: ``RestoreTarget.read`` holds
``read_data``, which holds the reads. The first restore reads what the save left in the page cache
(an async save writes its data files around it); ``--cold`` drops the files before every restore.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_restore_phases.py --size 256MiB --restores 12
[--two-tiers] [--cold]``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
from bench_stall import build
from peers_tiers import set_cache

from goodput_ckpt import CheckpointManager
from goodput_ckpt.cli._output import parse_size

#: (module, attribute): the restore path's phases.
PHASES = [
    ("goodput_ckpt.manager.chain", "PersistentChain.latest"),
    ("goodput_ckpt.manager.tiers", "Tiers.restore"),
    ("goodput_ckpt.manager.restoring", "RestoreTarget.reader"),
    ("goodput_ckpt.manager.restoring", "RestoreTarget.plan"),
    ("goodput_ckpt.manager.restoring", "RestoreTarget.read"),
    ("goodput_ckpt.manager.restoring", "RestoreTarget.decode"),
    ("goodput_ckpt.manager.restoring", "RestoreTarget.apply"),
    ("goodput_ckpt.dcp.reader", "CheckpointReader.shared_manifest"),
    ("goodput_ckpt.dcp.reader", "CheckpointReader.read_metadata"),
    ("goodput_ckpt.dcp.reader", "CheckpointReader.read_data"),
    ("goodput_ckpt.dcp.reader", "CheckpointReader._finish"),
    ("goodput_ckpt.dcp.reader", "item_request"),
    ("goodput_ckpt.dcp.reader", "plan_tasks"),
    ("goodput_ckpt.dcp.load_planner", "GridLoadPlanner.set_up_planner"),
    ("goodput_ckpt.dcp.load_planner", "GridLoadPlanner.create_local_plan"),
    ("goodput_ckpt.manager.restoring", "apply_restore"),
]

#: phase -> [wall s, thread CPU s] of the restore in progress.
current: dict[str, list[float]] = {}


def wrap(module: str, attr: str) -> None:
    owner: Any = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)
    label = attr

    def timed(*a: Any, **k: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc = current.setdefault(label, [0.0, 0.0])
            acc[0] += time.perf_counter() - t
            acc[1] += time.thread_time() - c

    setattr(owner, name, timed)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB", help="parameters + optimizer state (bench_peers' default)")
    ap.add_argument("--restores", type=int, default=12)
    ap.add_argument("--two-tiers", action="store_true", help="a local_dir tier, as bench_peers' manager-2tier")
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache before each restore")
    args = ap.parse_args(argv)
    for module, attr in PHASES:
        wrap(module, attr)
    scratch = Path(tempfile.mkdtemp(prefix="probe-restore-"))
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'pg'}", rank=0, world_size=1)
    try:
        model, opt, _fb, _step = build(parse_size(args.size), 8)
        kw: dict[str, Any] = {"local_dir": str(scratch / "local")} if args.two_tiers else {}
        root = str(scratch / "persistent")
        with CheckpointManager(root, keep_last=None, timeline=False, async_staging=False, **kw) as mgr:
            for step in (0, 1):
                mgr.save(step, model=model, optimizer=opt)
                mgr.wait()
        runs: dict[str, list[list[float]]] = defaultdict(list)
        for _ in range(args.restores):
            if args.cold:
                set_cache(scratch, "cold")
            with CheckpointManager(root, timeline=False, **kw) as mgr:
                current.clear()
                t, c, p = time.perf_counter(), time.thread_time(), time.process_time()
                assert mgr.restore(model=model, optimizer=opt) == 1
                current["TOTAL restore"] = [time.perf_counter() - t, time.thread_time() - c]
                current["TOTAL process cpu"] = [time.process_time() - p, float("nan")]
            for k, v in current.items():
                runs[k].append(v)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{'two tiers' if args.two_tiers else 'one tier'}, {args.size}, {args.restores} restores "
        f"({'cold' if args.cold else 'the first as the save left the cache, then warm'}); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'phase':45s} {'wall median (min) ms':>22s} {'caller-thread CPU median ms':>28s}")
    for k, vs in sorted(runs.items(), key=lambda kv: -statistics.median(x[0] for x in kv[1])):
        wall = [x[0] for x in vs]
        cpu = statistics.median(x[1] for x in vs)
        print(f"{k:45s} {1e3 * statistics.median(wall):12.1f} ({1e3 * min(wall):6.1f}) {1e3 * cpu:20.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
