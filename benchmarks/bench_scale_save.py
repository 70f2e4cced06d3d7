"""A save's planning and commit at W ranks, through the methods ``dcp.save`` calls, W simulated in one process.

For each simulated rank this runs what ``dcp.save`` (``state_dict_saver._save_state_dict``, torch
2.13) runs, in its order, with the real planner and writer objects:

1. every rank: ``writer.storage_meta()``, ``planner.set_up_planner(state_dict, storage_meta,
   is_coordinator)``, ``writer.set_up_storage_writer(is_coordinator, rank=, use_collectives=True)``,
   ``planner.create_local_plan()``, ``writer.prepare_local_plan(plan)``, then the plan pickled
   (``gather_object`` pickles it; its bytes counted);
2. coordinator: every plan unpickled, ``planner.create_global_plan(plans)``,
   ``writer.prepare_global_plan(plans)``, each final plan pickled (the scatter);
3. every rank: its plan unpickled, ``planner.finish_plan(plan)``, ``write_data``'s bookkeeping
   (below), its write results pickled (the ``all_reduce`` gather);
4. coordinator: every result unpickled, ``writer.finish(metadata, results)`` (the commit record
   built and published on a local directory; torch: its ``.metadata`` written), the ``Metadata``
   pickled (``dcp.save``'s result, broadcast); every rank unpickles it.

What is simulated, and why it equals the real path (the simulated inputs live in
``bench_scale_save_sim.py``):

- The state dict: a Llama-shaped model (``--layout``, as in ``bench_scale.py``) and AdamW state
  as FSDP2's ``get_state_dict`` nests it (``model.*``, ``optim.state.<fqn>.{exp_avg, exp_avg_sq,
  step}``, ``optim.param_groups``), every parameter and moment a DTensor ``Shard(0)`` over W ranks.
  Each DTensor is a stand-in (:class:`SimShard`) whose ``__create_write_items__`` returns the
  ``WriteItem`` torch's ``_create_write_items_for_dtensor`` builds, with the size and offset from
  torch's own ``_compute_local_shape_and_global_offset`` for that rank: ranks past a tensor's end
  get torch's empty shards (size 0 at offset ``dim 0``). ``step`` is a plain 0-d tensor on every
  rank, ``param_groups`` plain values, as FSDP2 gives them.
- ``write_data``: no data is hashed or written (data throughput is measured in
  ``bench_local.py``); the rank's bookkeeping is ``CheckpointWriter._write_rank``'s (items
  ordered, placed in files by ``place_items``, one ``RankWrites`` from ``rank_writes`` with
  file entries of made-up 8 MiB-chunk hashes), and for torch one ``WriteResult`` per item with
  its ``_StorageInfo`` (what ``FileSystemWriter`` returns).
- The transport: not counted; each payload is pickled once by its sender and unpickled by each
  receiver, as ``gather_object``/``scatter_object_list``/``broadcast_object_list`` do.

The garbage collector is off during the simulated saves (``--gc`` keeps it on): in one process
its passes scan the objects of every simulated rank (W planners, plan caches and plans), and land
in whichever rank's phase comes next, so each rank would be charged the others' heaps (seen: 1 to
3.5 s of collection in phases whose own work is 0.03 to 1 s, at W = 16). A real rank's passes
scan its own heap (on the coordinator: its plan cache, O(W x tensors) objects after a first
save); they are not counted here. The phases' ``gc wall`` column shows what remains (explicit
collections are outside the timed phases). The W state dicts are also frozen (``gc.freeze``).

Every rank's steps run (the coordinator needs every plan), but only rank 0 (coordinator), rank 1
(the worst other rank: with FSDP it holds a non-empty shard of every tensor) and rank W/2 (a
typical rank: empty shards of the tensors shorter than W rows) are timed phase by phase; the
"rank" rows of the output are those timed ranks only. Step 3 (``finish_plan`` and the write
bookkeeping) is also timed on every rank, and its worst other rank over all W - 1 is printed (the
local step cannot be: an untimed rank's shard boxes are computed once per run). CPU
(``process_time``) and wall (``perf_counter``); the coordinator's peak of Python allocations
(``tracemalloc``) on an extra first run, in two windows so that the other simulated ranks' allocations are not counted:
its global step (from the plans gathered to the plans scattered; plus the gathered plans' bytes)
and its commit (from the results gathered to the ``Metadata`` pickled; plus what the first
window left allocated, less the scattered bytes, plus the gathered results' bytes; the gathered
bytes as torch's ``gather_object`` holds them, every payload padded to the largest): the peak is
the larger, an upper estimate of the Python heap a save adds on the coordinator; min / median /
max over ``--repeats``. Each repeat runs save 1 (first save) and save 2 (same layout: what plan
caching reuses), the coordinator's layout entries forgotten before save 1.

Methods: ``ours`` (``ReplicaGroupingSavePlanner`` with a ``SavePlanCache`` + ``CheckpointWriter``,
what ``CheckpointManager`` runs: compact plans), ``ours-full`` (the same with ``compact=False``:
torch's ``WriteItem`` lists exchanged and planned, as before compact plans), ``ours-nocache`` (no
plan cache) and ``torch``
(``DefaultSavePlanner`` + ``FileSystemWriter``). Not torch's own ``enable_plan_caching``: its
cache is keyed by the planner's class name, one per process, so W ranks simulated in one process
would share it (and ``CheckpointWriter`` refuses it, docs/scale.md).

``--stream N`` (``bench_scale_save_stream.py``): the same saves with only the timed ranks in this
process and every other rank built, run and dropped step by step in N worker processes, so that
this process holds what a real coordinator holds (its own rank and the payloads gathered): W =
4,096 and 16,384 fit. Its coordinator figures are this mode's, measured the same way.

Run: ``python benchmarks/bench_scale_save.py --layout 70B --ranks 64,256 --methods ours,torch``;
``--check`` compares the per-rank figures with a real 8-rank gloo save (bench_scale_save_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_scale import MODELS  # noqa: E402
from bench_scale_save_sim import local_step, plan_cache, planner, state_dict, timed_ranks, write_step, writer  # noqa: E402

from goodput_ckpt.dcp.commit_build import forget_layouts  # noqa: E402

MB = 1e6


# -- one simulated save --------------------------------------------------------------------------------
class Clock:
    """CPU and wall seconds per (rank, phase), the part of the wall spent in the garbage
    collector, and bytes per payload."""

    def __init__(self) -> None:
        self.cpu: dict[tuple[str, str], float] = {}
        self.wall: dict[tuple[str, str], float] = {}
        self.gc: dict[tuple[str, str], float] = {}
        self.bytes: dict[str, int] = {}
        self.write_all: list[float] = []  # every rank's step-3 CPU, in rank order

    def run(self, who: str, phase: str, fn: Callable[[], Any]) -> Any:
        c0, w0, g0 = time.process_time(), time.perf_counter(), _GC.seconds
        out = fn()
        key = (who, phase)
        self.cpu[key] = self.cpu.get(key, 0.0) + time.process_time() - c0
        self.wall[key] = self.wall.get(key, 0.0) + time.perf_counter() - w0
        self.gc[key] = self.gc.get(key, 0.0) + _GC.seconds - g0
        return out


class _GcTime:
    """Seconds spent in the garbage collector's passes (``gc.callbacks``), to tell a phase's own
    work from a collection that the objects of earlier phases set off in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


_GC = _GcTime()


class Ranks:
    """The planners, writers and caches of W simulated ranks, all in this process: the plan caches
    kept from one save to the next, the planners and writers from a save's step 1 to its step 3.
    ``bench_scale_save_stream.StreamedRanks`` (``--stream``) is the same interface without W
    ranks' objects held at once."""

    def __init__(self, method: str, layout: str, world: int, root: str) -> None:
        self.method, self.world, self.root = method, world, root
        self.caches = [plan_cache(method) for _ in range(world)]
        self.states = [state_dict(layout, r, world) for r in range(world)]
        self.planners: list[Any] = []
        self.writers: list[Any] = []

    def local_step(self, save: int, timed: Callable[..., Any]) -> list[bytes]:
        """Step 1 on every rank, in rank order: the W pickled local plans (the gather's input)."""
        self.planners = [planner(self.method, self.caches[r]) for r in range(self.world)]
        self.writers = [writer(self.method, self.root, save) for _ in range(self.world)]
        return [
            timed(r, "local plan", lambda r=r: local_step(self.planners[r], self.writers[r], self.states[r], r))
            for r in range(self.world)
        ]

    def write_step(
        self, save: int, scattered: list[bytes], timed: Callable[..., Any]
    ) -> tuple[list[bytes], list[float]]:
        """Step 3 on every rank: the W pickled results, and each rank's CPU seconds."""
        results, cpu = [], []
        for r in range(self.world):
            c0 = time.process_time()
            results.append(timed(r, STEP3, lambda r=r: write_step(self.planners[r], self.method, scattered[r])))
            cpu.append(time.process_time() - c0)
        return results, cpu

    def coordinator(self) -> tuple[Any, Any]:
        return self.planners[0], self.writers[0]

    def end_save(self) -> None:
        self.planners, self.writers = [], []

    def close(self) -> None:
        pass


STEP3 = "finish_plan + write bookkeeping"


def one_save(ranks: Any, save: int, clock: Clock, traced: bool) -> None:
    """One ``dcp.save`` of every simulated rank (module doc, steps 1-4)."""
    W, who = ranks.world, timed_ranks(ranks.world)
    names = [who.get(r) for r in range(W)]

    def timed(r: int, phase: str, fn: Callable[[], Any]) -> Any:
        return fn() if names[r] is None else clock.run(names[r], phase, fn)

    blobs = ranks.local_step(save, timed)  # 1. local step
    planner0, writer0 = ranks.coordinator()
    clock.bytes["plans gathered"] = sum(map(len, blobs))
    clock.bytes["plans gathered, padded"] = W * max(map(len, blobs))  # gather_object pads to the largest
    if traced:  # the coordinator's global step (module doc: peak memory)
        gc.collect()
        tracemalloc.start()
    coord = "coordinator"
    plans = clock.run(coord, "gather: unpickle plans", lambda blobs=blobs: [pickle.loads(b) for b in blobs])
    del blobs
    final, metadata = clock.run(coord, "create_global_plan", lambda plans=plans: planner0.create_global_plan(plans))
    final = clock.run(coord, "prepare_global_plan", lambda final=final: writer0.prepare_global_plan(final))
    del plans
    scattered = clock.run(coord, "scatter: pickle plans", lambda final=final: [pickle.dumps(p) for p in final])
    del final
    clock.bytes["plans scattered"] = sum(map(len, scattered))
    if traced:
        peak_plan, held = tracemalloc.get_traced_memory()[::-1]
        tracemalloc.stop()  # the other ranks' step 3 is their memory, not the coordinator's
    # 3. finish_plan, write_data's bookkeeping (every rank timed: the worst of all)
    results, clock.write_all = ranks.write_step(save, scattered, timed)
    del scattered
    clock.bytes["results gathered"] = sum(map(len, results))
    clock.bytes["results gathered, padded"] = W * max(map(len, results))
    if traced:  # the coordinator's commit
        gc.collect()
        tracemalloc.start()
    all_results = clock.run(
        coord, "gather: unpickle results", lambda results=results: [pickle.loads(b) for b in results]
    )
    del results
    clock.run(coord, "finish (commit)", lambda all_results=all_results: writer0.finish(metadata, all_results))
    del all_results
    blob = clock.run(coord, "broadcast: pickle Metadata", lambda: pickle.dumps(metadata))
    clock.bytes["Metadata broadcast"] = len(blob)
    if traced:
        peak_commit = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        b = clock.bytes
        plan_window = b["plans gathered, padded"] + peak_plan
        commit_window = held - b["plans scattered"] + b["results gathered, padded"] + peak_commit
        clock.bytes["coordinator peak MB"] = int(max(plan_window, commit_window) / MB)
        clock.bytes["plan window MB"] = int(plan_window / MB)
        clock.bytes["commit window MB"] = int(commit_window / MB)
        clock.bytes["held after the global step MB"] = int(held / MB)
    for r in range(W):
        if names[r] is not None and r:
            clock.run(names[r], "broadcast: unpickle Metadata", lambda: pickle.loads(blob))
    ranks.end_save()


def measure(
    method: str, layout: str, world: int, repeats: int, memory: bool, collector: bool = False, stream: int = 0
) -> dict[str, Any]:
    """``stream``: 0 simulates every rank in this process (``Ranks``); N > 0 streams the ranks
    other than the timed ones through N worker processes (``bench_scale_save_stream.py``)."""
    runs: dict[int, list[Clock]] = {1: [], 2: []}
    peaks: dict[int, int] = {}
    windows: dict[int, dict[str, int]] = {}
    for rep in range(repeats + (1 if memory else 0)):
        with tempfile.TemporaryDirectory(prefix="bench-save-") as root:
            traced = memory and rep == 0
            forget_layouts()  # a first save of a run: the coordinator holds no layout yet
            if stream:
                import bench_scale_save_stream as streamed  # noqa: PLC0415 - only this mode forks

                streamed.tokens()  # each save's token the same in every repeat (its module doc, Repeats)
                ranks = streamed.StreamedRanks(method, layout, world, root, stream)
            else:
                ranks = Ranks(method, layout, world, root)
            # The W state dicts live in this one process (a real rank holds its own): kept out of
            # the collector's scans, which otherwise land, long, in whichever phase comes next.
            gc.collect()
            gc.freeze()
            if not collector:
                gc.disable()  # module doc: in one process its passes scan every simulated rank's objects
            for save in (1, 2):
                clock = Clock()
                one_save(ranks, save, clock, traced)
                if traced:
                    peaks[save] = clock.bytes.pop("coordinator peak MB")
                    windows[save] = {k: v for k, v in clock.bytes.items() if k.endswith(" MB")}
                else:
                    runs[save].append(clock)
            gc.enable()
            gc.unfreeze()
            ranks.close()
            del ranks
            gc.collect()
    if stream:
        streamed.forget_payloads()
    out: dict[str, Any] = {"method": method, "layout": layout, "world": world, "stream": stream, "saves": {}}
    for save, clocks in runs.items():
        row: dict[str, Any] = {
            "bytes": clocks[0].bytes,
            "coordinator peak MB": peaks.get(save),
            "coordinator peak windows": windows.get(save),
        }
        for who in timed_ranks(world).values():
            for kind in ("cpu", "wall"):
                totals = sorted(sum(v for (w, _), v in getattr(c, kind).items() if w == who) for c in clocks)
                row[f"{who} {kind} s"] = {"min": totals[0], "median": statistics.median(totals), "max": totals[-1]}
            row[f"{who} phases cpu s"] = {
                ph: statistics.median(c.cpu.get((who, ph), 0.0) for c in clocks)
                for (w, ph) in clocks[0].cpu
                if w == who
            }
            row[f"{who} phases gc s"] = {
                ph: statistics.median(c.gc.get((who, ph), 0.0) for c in clocks) for (w, ph) in clocks[0].gc if w == who
            }
        # Step 3 is timed on every rank: its worst other rank over all W-1, not only the timed ones.
        worst = sorted(max(c.write_all[1:], default=0.0) for c in clocks)
        row["step 3 worst of all other ranks cpu s"] = {
            "min": worst[0],
            "median": statistics.median(worst),
            "max": worst[-1],
            "rank": max(range(1, world), key=lambda r: clocks[0].write_all[r], default=None),
        }
        out["saves"][save] = row
    return out


def print_row(row: dict[str, Any]) -> None:
    W = row["world"]
    for save, r in row["saves"].items():
        label = "first save" if save == 1 else "later save, same layout"
        print(
            f"\n{row['method']} {row['layout']} W={W}, {label}:  bytes {r['bytes']}, coordinator peak {r['coordinator peak MB']} MB"
            f" {r.get('coordinator peak windows')}"
        )
        for who in timed_ranks(W).values():
            cpu, wall = r[f"{who} cpu s"], r[f"{who} wall s"]
            print(
                f"  {who:<12} cpu {cpu['min']:8.3f} / {cpu['median']:8.3f} / {cpu['max']:8.3f} s   wall median {wall['median']:8.3f} s"
            )
            gcs = r[f"{who} phases gc s"]
            for ph, s in r[f"{who} phases cpu s"].items():
                print(f"      {ph:<34} {s:8.3f}   (gc wall {gcs.get(ph, 0.0):.3f})")
        w = r["step 3 worst of all other ranks cpu s"]
        print(
            f"  (the rank rows are the timed ranks only; step 3, finish_plan + write bookkeeping, timed on every "
            f"rank: its worst other rank {w['min']:.3f} / {w['median']:.3f} / {w['max']:.3f} s, rank {w['rank']} "
            "in the first repeat)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="70B", choices=sorted(MODELS))
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--methods", default="ours,torch", help="from ours, ours-full, ours-nocache, torch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--gc", action="store_true", help="keep the garbage collector on (its passes scan every simulated rank's heap)"
    )
    ap.add_argument(
        "--stream",
        type=int,
        default=0,
        metavar="N",
        help="stream the untimed ranks through N worker processes (bench_scale_save_stream.py); 0: all in this process",
    )
    ap.add_argument("--json")
    ap.add_argument(
        "--check", action="store_true", help="compare with a real 8-rank gloo save (bench_scale_save_check.py)"
    )
    args = ap.parse_args(argv)
    if args.check:
        from bench_scale_save_check import run_check  # noqa: PLC0415 - only this mode spawns processes

        return run_check(8)
    unknown = set(args.methods.split(",")) - {"ours", "ours-full", "ours-nocache", "torch"}
    if unknown:
        ap.error(f"unknown method(s) {', '.join(sorted(unknown))}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        for method in args.methods.split(","):
            row = measure(method, args.layout, world, args.repeats, not args.no_memory, args.gc, args.stream)
            print_row(row)
            sys.stdout.flush()
            rows.append(row)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # Linux: KiB
    print(
        f"load average at the end {os.getloadavg()[0]:.1f}; this process's peak RSS {peak_rss:.0f} MB (workers not counted)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
