"""Why rank 0's ``read_metadata`` looked slower (issue 37): does it do more work, or the same work
in a different process?

W gloo ranks save ``bench_restore_layout``'s FSDP2 + AdamW state, then each rank reads the record
``--reads`` times, one rank at a time (a different rank first each round). Per rank it prints the
tracked objects its process holds, the Python calls of one ``read_metadata`` (``sys.setprofile``:
a count, not a time), and per read its thread CPU and the collections the cyclic collector ran
inside it (generation and thread CPU, from ``gc.callbacks``). ``--forget`` drops the coordinator's
remembered layout (``forget_layouts``) after the save.

Usage: ``python benchmarks/probe_restore_rank0.py [--world 2] [--reads 16] [--forget]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_restore_control import _free_port, _init, _save, _state  # noqa: E402


def _rank(rank: int, world: int, port: int, reads: int, forget: bool, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from goodput_ckpt import CheckpointReader
    from goodput_ckpt.dcp.commit_build import forget_layouts

    _init(rank, world, port)
    path = os.path.join(root, "ck")
    _save(_state(init_device_mesh("cpu", (world,)), 600), path)
    if forget:
        forget_layouts()
    dist.barrier()
    CheckpointReader(path).read_metadata()  # warm
    calls = [0]

    def count(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    CheckpointReader(path).read_metadata()
    sys.setprofile(None)
    events: list[tuple[int, float]] = []
    started = [0.0]

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            events.append((info["generation"], time.thread_time() - started[0]))

    rows = []
    for i in range(reads):
        for r in [(i + k) % world for k in range(world)]:
            if r == rank:
                gens = [len(gc.get_objects(g)) for g in range(3)]
                events.clear()
                gc.callbacks.append(collected)
                t0 = time.thread_time()
                CheckpointReader(path).read_metadata()
                cpu = time.thread_time() - t0
                gc.callbacks.remove(collected)
                rows.append({"cpu": cpu, "generations": gens, "collections": list(events)})
            dist.barrier()
    result = {"objects": len(gc.get_objects()), "calls": calls[0], "reads": rows}
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reads", type=int, default=16)
    ap.add_argument("--forget", action="store_true", help="forget_layouts() after the save")
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank,
            args=(args.world, _free_port(), args.reads, args.forget, root, out),
            nprocs=args.world,
            start_method="spawn",
            join=True,
        )
        for r in range(args.world):
            with open(os.path.join(out, f"r{r}.json")) as f:
                d = json.load(f)
            rows = d["reads"]
            gc_cpu = [sum(c[1] for c in x["collections"]) for x in rows]
            kinds = sorted({c[0] for x in rows for c in x["collections"]})
            per_gen = {g: sum(c[0] == g for x in rows for c in x["collections"]) / len(rows) for g in kinds}
            print(
                f"rank {r}: {d['objects']} tracked objects, {d['calls']} Python calls per read_metadata; "
                f"thread CPU median {statistics.median(x['cpu'] for x in rows):.4f} s, of which collections "
                f"{statistics.median(gc_cpu):.4f} s; collections per read by generation {per_gen}; "
                f"objects by generation before the last read {rows[-1]['generations']}"
            )
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
