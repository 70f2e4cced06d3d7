"""Issue 37's restore at 8 gloo ranks against 2, with a control for the machine's contention.

``bench_restore_layout.py`` found the worst rank's ``read_metadata`` about 1.24x dearer at 8 ranks
than at 2 on this 2-core machine, while the same records read in one process cost 0.93x. That
leaves two readings: work that grows with W, or 8 processes on 2 cores. This benchmark tells them
apart in one run. ``--world`` (8) gloo processes hold the state of ``bench_restore_layout``'s
FSDP2 + AdamW model twice: sharded over all of them, and sharded over pairs of them (a 2-D device
mesh ``(world / small, small)``: each pair is a ``small``-rank job with its own process group).
They restore it with ``dcp.load`` (``CheckpointReader``, ``GridLoadPlanner``: the manager's
reader and planner; verified reads) in three modes, every repeat, in a rotating order:

- ``big``: the ``world``-rank job: every process restores the ``world``-rank checkpoint;
- ``jobs``: ``world / small`` concurrent ``small``-rank jobs: every process restores the
  ``small``-rank checkpoint (saved beforehand by a real ``small``-rank job) over its pair's group:
  the same 8 processes, the same contention, W = 2 work;
- ``one``: one ``small``-rank job (the first pair) while the other processes wait in a barrier.

If ``big`` costs what ``jobs`` costs, the growth from ``one`` to ``big`` is the contention, not W.
Each rank's CPU is split into phases by timers this process wraps around the library's functions
(thread CPU clocks, ``time.thread_time``; nothing changes what runs):

- ``record``: reading the commit record (and, where shared, its broadcast), less the two below;
- ``parse``: ``parse_manifest`` (JSON decoding and validation); ``files``: the data files' size checks;
- ``metadata``: ``to_dcp_metadata``; ``plan``: everything of ``dcp.load`` between ``read_metadata``
  and ``read_data`` on the main thread (planning, the plan gather and scatter);
- ``reads`` and ``hash``: ``CheckpointReader._read_task`` and ``bad_chunks`` (blake3), on
  whichever thread runs them; ``deliver``: the rest of ``read_data`` on the main thread (copies
  into the destination tensors); ``finish``: after ``read_data`` (the final gather);
- ``ours``: the main thread's CPU plus the reader threads'; ``other``: the process's CPU
  (``process_time``) less ``ours``: threads that are not this load's (gloo's, the TCPStore
  server that rank 0 hosts);
- counts, not times: the calls and tensor bytes of torch's collectives on each rank (its object
  collectives go through them), and the process's minor page faults.

Usage: ``python benchmarks/bench_restore_control.py [--world 8] [--small 2] [--repeats 5]
[--layers 600] [--json PATH]``. At 8 processes it needs about 3 GB of memory and a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_restore_layout import _fmt, _free_port, _spread, fsdp_state  # noqa: E402

MODES = ("big", "jobs", "one")
COUNTS = ("collective calls", "collective bytes", "minor faults")
PHASES = ("record", "parse", "files", "metadata", "plan", "reads", "hash", "deliver", "finish")


class _Timers:
    """Thread-CPU timers around the library's functions, in this process only (see the doc)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.worker = 0.0  # reads and hashes on threads other than the main one
        self.main = threading.get_ident()
        self.marks: dict[str, float] = {}

    def add(self, name: str, dt: float) -> None:
        self.acc[name] = self.acc.get(name, 0.0) + dt
        if threading.get_ident() != self.main:
            self.worker += dt

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, time.thread_time() - t0)

        return timed

    def wrap_gen(self, name: str, fn):
        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                yield from fn(*a, **k)
            finally:
                self.add(name, time.thread_time() - t0)

        return timed

    def count_collectives(self) -> None:
        """Count the calls and tensor bytes (in and out, on this rank) of torch's collectives,
        which its object collectives (``dcp.load``'s gather, scatter, all-gather) go through."""
        import torch
        from torch.distributed import distributed_c10d as c10d

        def nbytes(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(nbytes(y) for y in x)
            return 0

        def wrap(name: str, fn):
            def counted(*a, **k):
                self.acc["collective calls"] = self.acc.get("collective calls", 0) + 1
                moved = sum(nbytes(x) for x in (*a, *k.values()))
                self.acc["collective bytes"] = self.acc.get("collective bytes", 0) + moved
                return fn(*a, **k)

            return counted

        for name in ("broadcast", "all_gather", "gather", "scatter", "all_reduce", "reduce", "all_to_all"):
            setattr(c10d, name, wrap(name, getattr(c10d, name)))

    def install(self) -> None:
        self.count_collectives()
        from goodput_ckpt.dcp import reader as rd
        from goodput_ckpt.engine import manifest_load as ml
        from goodput_ckpt.format import commit_record as cr

        rd.load_shared = self.wrap("record+", rd.load_shared)
        cr.parse_manifest = self.wrap("parse", cr.parse_manifest)
        ml.file_problems = self.wrap_gen("files", ml.file_problems)
        rd.to_dcp_metadata = self.wrap("metadata", rd.to_dcp_metadata)
        rd.bad_chunks = self.wrap("hash", rd.bad_chunks)
        cls = rd.CheckpointReader
        cls._read_task = self.wrap("reads", cls._read_task)
        read_metadata, read_data = cls.read_metadata, cls.read_data

        def metadata(reader):
            out = read_metadata(reader)
            self.marks["metadata_end"] = time.thread_time()
            return out

        def data(reader, plan, planner):
            t0 = self.marks["read_data_start"] = time.thread_time()
            try:
                return read_data(reader, plan, planner)
            finally:
                self.marks["read_data_end"] = time.thread_time()
                self.acc["read_data"] = time.thread_time() - t0

        cls.read_metadata, cls.read_data = metadata, data

    def load(self, sd: dict, path: str, group) -> dict[str, float]:
        """One ``dcp.load`` of ``sd`` from ``path`` over ``group``: its CPU by phase and wall."""
        import torch.distributed.checkpoint as dcp

        from goodput_ckpt import CheckpointReader
        from goodput_ckpt.dcp.load_planner import GridLoadPlanner

        self.acc, self.worker, self.marks = {}, 0.0, {}
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        reader = CheckpointReader(path, process_group=group)
        dcp.load(sd, storage_reader=reader, planner=GridLoadPlanner(), process_group=group)
        p1, m1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        a, marks = self.acc, self.marks
        inner = a.get("parse", 0.0) + a.get("files", 0.0)
        main_reads = a.get("reads", 0.0) + a.get("hash", 0.0) - self.worker
        ours = (m1 - m0) + self.worker
        return {
            "record": a.get("record+", 0.0) - inner,
            "parse": a.get("parse", 0.0),
            "files": a.get("files", 0.0),
            "metadata": a.get("metadata", 0.0),
            "plan": marks["read_data_start"] - marks["metadata_end"],
            "reads": a.get("reads", 0.0),
            "hash": a.get("hash", 0.0),
            "deliver": a["read_data"] - main_reads,
            "finish": m1 - marks["read_data_end"],
            "ours": ours,
            "other": (p1 - p0) - ours,
            "process": p1 - p0,
            "wall": w1 - w0,
            "collective calls": a.get("collective calls", 0),
            "collective bytes": a.get("collective bytes", 0),
            "minor faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
        }


def _init(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _save(sd: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter
    from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner

    dcp.save(sd, storage_writer=CheckpointWriter(path), planner=ReplicaGroupingSavePlanner())


def _save_job(rank: int, world: int, port: int, layers: int, path: str) -> None:
    """A real ``world``-rank job saves its checkpoint (the writer's layout follows the default group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, port)
    _save(fsdp_state(init_device_mesh("cpu", (world,)), layers), path)
    dist.destroy_process_group()


def _rank(rank: int, world: int, small: int, port: int, layers: int, repeats: int, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, port)
    big_sd = fsdp_state(init_device_mesh("cpu", (world,)), layers)
    pairs = init_device_mesh("cpu", (world // small, small), mesh_dim_names=("job", "shard"))
    small_sd = fsdp_state(pairs["shard"], layers)
    small_group = pairs.get_group("shard")
    big_path, small_path = os.path.join(root, f"w{world}"), os.path.join(root, f"w{small}")
    _save(big_sd, big_path)
    timers = _Timers()
    timers.install()
    runs = {
        "big": lambda: timers.load(big_sd, big_path, None),
        "jobs": lambda: timers.load(small_sd, small_path, small_group),
        "one": lambda: timers.load(small_sd, small_path, small_group) if rank < small else None,
    }
    dist.barrier()
    for mode in MODES:  # warm: imports, the page cache, the pools' threads
        runs[mode]()
        dist.barrier()
    result: dict = {"order": [], "load": [], **{m: [] for m in MODES}}
    for i in range(repeats):
        order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
        result["order"].append(list(order))
        result["load"].append(os.getloadavg()[0])
        for mode in order:
            dist.barrier()
            result[mode].append(runs[mode]())
        dist.barrier()
    Path(out, f"r{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(world: int, small: int, layers: int, repeats: int) -> dict:
    """Save the ``small``-rank checkpoint with a real ``small``-rank job, then run the modes."""
    import torch.multiprocessing as mp

    if world % small or world <= small:
        raise ValueError(f"--world ({world}) must be a multiple of --small ({small}) above it")
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        spawn = dict(nprocs=small, start_method="spawn", join=True)
        mp.start_processes(_save_job, args=(small, _free_port(), layers, os.path.join(root, f"w{small}")), **spawn)
        spawn["nprocs"] = world
        mp.start_processes(_rank, args=(world, small, _free_port(), layers, repeats, root, out), **spawn)
        ranks = [json.loads(Path(out, f"r{r}.json").read_text()) for r in range(world)]
    return summarize(ranks, small)


def summarize(ranks: list[dict], small: int) -> dict:
    """Worst rank per repeat, min/median/max over the repeats; ratios within each repeat."""
    repeats = len(ranks[0]["order"])
    fig: dict = {"world": len(ranks), "small": small, "repeats": repeats, "order": ranks[0]["order"]}
    fig["load"] = _spread(ranks[0]["load"])
    worst: dict[str, dict[str, list[float]]] = {}
    for mode in MODES:
        rows = [r[mode] for r in (ranks[:small] if mode == "one" else ranks)]
        worst[mode] = {k: [max(rr[i][k] for rr in rows) for i in range(repeats)] for k in ("ours", "process", "wall")}
        fig[mode] = {k: _spread(v) for k, v in worst[mode].items()}
        # Each phase: the worst rank's per repeat (phases of different ranks: not a sum).
        fig[mode]["phases"] = {
            p: statistics.median(max(rr[i][p] for rr in rows) for i in range(repeats)) for p in (*PHASES, "other")
        }
        fig[mode]["rank_medians"] = {
            k: [statistics.median(x[k] for x in rr) for rr in rows] for k in ("ours", "other", "process", *COUNTS)
        }
    fig["ratios"] = {
        f"{a}/{b} {k}": _spread([worst[a][k][i] / worst[b][k][i] for i in range(repeats)])
        for a, b in (("big", "jobs"), ("big", "one"), ("jobs", "one"))
        for k in ("ours", "process", "wall")
    }
    return fig


def report(fig: dict) -> str:
    lines = [f"world {fig['world']}, jobs of {fig['small']}, {fig['repeats']} repeats, load {_fmt(fig['load'])}"]
    for mode in MODES:
        f = fig[mode]
        lines.append(
            f"  {mode:4s}: worst rank CPU ours {_fmt(f['ours'])} s, process {_fmt(f['process'])} s, "
            f"wall {_fmt(f['wall'])} s (min/median/max)"
        )
        lines.append(
            "        phases (worst rank, median): " + ", ".join(f"{p} {v:.4f}" for p, v in f["phases"].items())
        )
        for k in ("ours", "other"):
            lines.append(f"        rank medians, {k}: " + " ".join(f"{v:.4f}" for v in f["rank_medians"][k]))
        for k in COUNTS:
            lines.append(f"        rank medians, {k}: " + " ".join(f"{v:.0f}" for v in f["rank_medians"][k]))
    for name, spread in fig["ratios"].items():
        lines.append(f"  {name}: {_fmt(spread)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8, help="processes, and the big job's ranks")
    ap.add_argument("--small", type=int, default=2, help="ranks of each small job")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--layers", type=int, default=600, help="nn.Linear layers: 4 items each with AdamW, x2")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    start = os.getloadavg()
    print(f"load average at start: {start}", flush=True)
    fig = run(args.world, args.small, args.layers, args.repeats)
    fig["load_average_start"], fig["load_average_end"] = start, os.getloadavg()
    print(report(fig), flush=True)
    print(f"load average at end: {fig['load_average_end']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
