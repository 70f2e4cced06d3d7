"""Where an incremental LoRA save's time goes, phase by phase, against the trainable state alone.

Issue 40: an incremental save of a LoRA job on a frozen GPT-2-style base should cost at most
1.2x a save of the trainable state alone (``bench_incremental.py``). This probe runs the
benchmark's two managers (``incremental`` on the whole model, ``trainable`` on the adapters) in
one process, synchronous saves on local disk, and times each phase of every save after the
first with ``perf_counter`` and the calling thread's CPU clock (``time.thread_time``: the phases
below run in the caller's thread; the writer's pool threads are not in it). No profiler:
cProfile inflates torch's ``TensorProperties.create_from_tensor`` about 500-fold and blames the
planner. Phases nest (``dcp.save`` holds the planner's and the writer's), so each is inclusive.

Figures: docs/benchmarks.md, "Incremental saves", runs 14 to 17 (the per-phase table).

Run: ``.venv/bin/python benchmarks/probe_incremental_phases.py --saves 40``.
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
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_incremental as bench  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")

#: (module or class, attribute, phase name): what is timed. Module functions are patched where
#: they are called (the name the caller looks up).
PHASES: list[tuple[str, str, str]] = [
    ("goodput_ckpt.manager.checkpoint_manager:CheckpointManager", "save", "manager.save"),
    ("goodput_ckpt.manager.save_job:SaveJobs", "finish_previous", "finish_previous"),
    ("goodput_ckpt.manager.saving", "build_save_state", "state dict"),
    ("goodput_ckpt.manager.incremental_saves:IncrementalSaves", "plan", "tracker plan"),
    ("goodput_ckpt.manager.saving", "CheckpointWriter", "writer init"),
    ("torch.distributed.checkpoint", "save", "dcp.save"),
    ("goodput_ckpt.dcp.save_planner:ReplicaGroupingSavePlanner", "create_local_plan", " local plan"),
    ("torch.distributed.checkpoint.default_planner:DefaultSavePlanner", "create_local_plan", "  torch local plan"),
    ("goodput_ckpt.dcp.save_planner", "compact_local", "  compact_local"),
    ("goodput_ckpt.dcp.save_planner:ReplicaGroupingSavePlanner", "create_global_plan", " global plan"),
    ("goodput_ckpt.dcp.save_planner:ReplicaGroupingSavePlanner", "finish_plan", " finish plan"),
    ("goodput_ckpt.dcp.writer:CheckpointWriter", "write_data", " write_data"),
    ("goodput_ckpt.dcp.writer", "referenced_items", "  referenced_items"),
    ("goodput_ckpt.dcp.writer", "write_hashed_files", "  write files"),
    ("goodput_ckpt.dcp.writer", "rank_report", "  rank_report"),
    ("goodput_ckpt.dcp.writer:CheckpointWriter", "finish", " finish"),
    ("goodput_ckpt.dcp.writer", "build_manifest", "  build_manifest"),
    ("goodput_ckpt.dcp.writer", "publish_manifest", "  publish_manifest"),
    ("goodput_ckpt.format.schema:Manifest", "to_json", "   to_json"),
    ("goodput_ckpt.engine.hashed_write", "parse_manifest", "   self-check parse"),
    ("goodput_ckpt.engine.hashed_write", "check_commit_record", "   self-check"),
    ("goodput_ckpt.dcp.writer", "remove_stale_files_after_commit", "  stale files"),
    ("goodput_ckpt.manager.incremental_saves:IncrementalSaves", "committed", "tracker committed"),
    ("goodput_ckpt.manager.save_job:SaveJobs", "wait_durable", "wait_durable"),
    ("goodput_ckpt.manager.save_job", "note_committed", "note_committed"),
    ("goodput_ckpt.manager.chain:PersistentChain", "apply_retention", "retention (wait)"),
    ("goodput_ckpt.manager.background_retention", "apply_retention", " retention (thread)"),
    ("goodput_ckpt.manager.retention", "scan_steps", "  scan_steps"),
    ("goodput_ckpt.manager.retention", "spare_referenced", "  spare_referenced"),
    ("goodput_ckpt.manager.retention", "delete_step", "  delete_step"),
]


class Clock:
    """Inclusive wall and thread-CPU seconds per phase, for the manager being timed."""

    def __init__(self) -> None:
        self.current = "off"
        self.wall: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.cpu: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.this_save: dict[tuple[str, str], list[float]] = {}

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = self.this_save.setdefault((self.current, name), [0.0, 0.0])
                acc[0] += time.perf_counter() - w
                acc[1] += time.thread_time() - c

        return timed

    def end_save(self, keep: bool) -> None:
        if keep:
            for k, (w, c) in self.this_save.items():
                self.wall[k].append(w)
                self.cpu[k].append(c)
        self.this_save = {}


def install(clock: Clock) -> None:
    import importlib

    for target, attr, name in PHASES:
        mod_name, _, cls = target.partition(":")
        owner: Any = importlib.import_module(mod_name)
        if cls:
            owner = getattr(owner, cls)
        if not hasattr(owner, attr):
            continue  # a phase this code does not have
        setattr(owner, attr, clock.wrap(getattr(owner, attr), name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--saves", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    clock = Clock()
    install(clock)
    model, trainable = bench.lora_model(args.layers, args.width)
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-4)
    scratch = Path(tempfile.mkdtemp(prefix="probe-phases-"))
    methods = {"incremental": model, "trainable": trainable}
    managers = {
        m: CheckpointManager(
            str(scratch / m), keep_last=2, async_save=False, incremental=(m == "incremental"), timeline=False
        )
        for m in methods
    }
    totals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    load0 = os.getloadavg()
    try:
        order = list(methods)
        for i in range(1, args.saves + 1):
            bench.train_steps(model, opt, 1, i)
            order = order[::-1]
            for m in order:
                clock.current = m
                w, c = time.perf_counter(), time.thread_time()
                managers[m].save(i, model=methods[m], optimizer=opt)
                if i > 1:
                    totals[m].append((time.perf_counter() - w, time.thread_time() - c))
                clock.end_save(keep=i > 1)
        for mgr in managers.values():
            mgr.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}; {args.saves - 1} saves each (after the first)")
    print(
        f"{'phase, median ms':24s} {'incr wall':>9s} {'incr cpu':>9s} {'train wall':>10s} {'train cpu':>9s} {'cpu diff':>8s}"
    )
    w = {m: statistics.median(x[0] for x in totals[m]) for m in methods}
    c = {m: statistics.median(x[1] for x in totals[m]) for m in methods}
    print(
        f"{'whole save':24s} {1e3 * w['incremental']:9.2f} {1e3 * c['incremental']:9.2f} "
        f"{1e3 * w['trainable']:10.2f} {1e3 * c['trainable']:9.2f} {1e3 * (c['incremental'] - c['trainable']):8.2f}"
    )
    for _, _, name in PHASES:
        cols = []
        for m in methods:
            k = (m, name)
            cols.append(
                (statistics.median(clock.wall[k]), statistics.median(clock.cpu[k])) if k in clock.wall else (0.0, 0.0)
            )
        if cols == [(0.0, 0.0)] * 2:
            continue
        (iw, ic), (tw, tc) = cols
        print(f"{name:24s} {1e3 * iw:9.2f} {1e3 * ic:9.2f} {1e3 * tw:10.2f} {1e3 * tc:9.2f} {1e3 * (ic - tc):8.2f}")


if __name__ == "__main__":
    main()
