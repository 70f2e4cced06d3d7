"""``CheckpointReader.read_metadata`` on a real FSDP2 + AdamW layout, at W = 2, 4 and 8 gloo ranks.

Issue 37 ("Restore on a real layout"): a real FSDP2 + AdamW save on gloo (about 4,800 small
tensors) read back with ``read_metadata`` cost 1.5-2.0x more at 8 ranks than at 2. This runs
that case for real: W processes join a gloo group, shard a model of small ``nn.Linear`` layers
with ``fully_shard`` (row counts that leave uneven shards at every W, and layers with fewer rows
than ranks, so that ranks past a tensor's end hold empty shards), take one AdamW step, and save
model and optimizer state (``get_state_dict``) through ``dcp.save`` with the manager's planner
(``ReplicaGroupingSavePlanner``) and ``CheckpointWriter`` on a local disk. Then every rank times
``CheckpointReader(path).read_metadata()``, CPU (``process_time``, and ``thread_time`` of the
calling thread, which excludes gloo's threads and rank 0's TCPStore server) and wall, ``--repeats``
times:

- ``alone``: one rank at a time while the others wait in a barrier, a different rank first in
  each repeat: the work one rank does, without the other ranks competing for this machine's 2 cores;
- ``together``: every rank at once, as ``dcp.load`` calls it (wall then includes the contention).

For each W the worst rank's figure of each repeat is kept, then min/median/max over the repeats.
Finally each rank runs it once under ``cProfile`` (alone) and the parent prints the top
functions of the worst rank, so the part that grows with W can be read off at 8 against 2.

``--old-layout`` also saves the same state with the byte layout before issue 37's second fix
(each rank's items packed at their own sizes, its replicated values first: a tensor's shards at a
different offset in each rank's file, about one grid run per rank in the record) and times both
checkpoints interleaved in the same run. The old layout is this process's own replacement of
``goodput_ckpt.dcp.writer.rank_placements`` by ``place_items`` of the sizes alone, made here only:
the library has no switch for it.

Usage: ``python benchmarks/bench_restore_layout.py [--worlds 2 4 8] [--repeats 5] [--layers 600]``
(``--json PATH`` writes the figures, ``--keep DIR`` keeps the checkpoints, ``--old-layout``). On a 2-core machine W = 8 needs about 3 GB of memory and a
few minutes. ``bench_restore_control.py`` is the control for the machine's contention (the
8-rank restore against four concurrent 2-rank ones on the same 8 processes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

#: Output rows of the layers, cycled: 3, 5 and 7 rows leave ranks past the tensor's end with
#: empty shards at W = 4 and 8; 9, 13, 17, 33 and 50 split unevenly at every W tried here.
ROWS = (3, 5, 7, 9, 13, 17, 33, 50)
IN_FEATURES = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stack(torch.nn.Module):
    """Small layers side by side (``fully_shard`` needs a module with a ``forward``)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(IN_FEATURES, ROWS[i % len(ROWS)]) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(m(x).sum() for m in self.layers)


def fsdp_state(mesh, layers: int) -> dict:
    """The FSDP2 + AdamW state of this benchmark's model (one optimizer step taken), sharded
    over ``mesh``, as ``get_state_dict`` gives it: ``{"model": ..., "optim": ...}``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _Stack(layers)
    for m in model.layers:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, IN_FEATURES)).backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _time(fn) -> tuple[float, float, float]:
    """CPU of the process (every thread: gloo's, rank 0's TCPStore server), wall, and CPU of
    this thread (``read_metadata`` runs on it alone on a local disk)."""
    c0, w0, t0 = time.process_time(), time.perf_counter(), time.thread_time()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0, time.thread_time() - t0


def _rank(
    rank: int, world: int, root: str, port: int, layers: int, repeats: int, old: bool, out: str, keep: str | None
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from goodput_ckpt import CheckpointReader, CheckpointWriter
    from goodput_ckpt.dcp import writer as writer_module
    from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner
    from goodput_ckpt.engine.layout import place_items

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = fsdp_state(init_device_mesh("cpu", (world,)), layers)
    msd, osd = state["model"], state["optim"]
    base = keep or os.path.join(root, f"w{world}")
    paths = {"new": base, "old": base + "_old"} if old else {"new": base}
    shipped = writer_module.rank_placements
    for which, path in paths.items():
        # The old layout: this benchmark's own stand-in, for its own process only (see the doc).
        writer_module.rank_placements = shipped if which == "new" else (lambda s, _sh, n, _w: place_items(s, n))
        sd = {"model": msd, "optim": osd}
        dcp.save(sd, storage_writer=CheckpointWriter(path), planner=ReplicaGroupingSavePlanner())
    writer_module.rank_placements = shipped
    dist.barrier()

    result: dict = {}
    for which, path in paths.items():
        CheckpointReader(path).read_metadata()  # warm: imports, the page cache
        result[which] = {"alone": [], "together": []}
    for i in range(repeats):
        for which, path in paths.items():  # interleaved: the machine's load falls on both alike

            def read(path: str = path) -> None:
                CheckpointReader(path).read_metadata()

            # alone: a different rank first in each repeat (the first one follows the
            # "together" reads of every rank, in caches they left cold)
            for r in [(i + k) % world for k in range(world)]:
                if r == rank:
                    result[which]["alone"].append(_time(read))
                dist.barrier()
            result[which]["together"].append(_time(read))
            dist.barrier()
    for which, path in paths.items():
        for r in range(world):
            if r == rank:
                prof = cProfile.Profile(time.process_time)  # CPU: other processes' load not counted
                prof.runcall(lambda path=path: CheckpointReader(path).read_metadata())
                prof.dump_stats(os.path.join(out, f"w{world}_{which}_r{rank}.prof"))
            dist.barrier()
    md = CheckpointReader(base).read_metadata()
    result["items"] = len(md.state_dict_metadata)
    result["chunks"] = sum(len(getattr(v, "chunks", ())) for v in md.state_dict_metadata.values())
    for which, path in paths.items():
        result[which]["record"] = _record(path)
    Path(out, f"w{world}_r{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _record(path: str) -> dict:
    """The commit record's size, grid runs and bytes of all data files (the layout's padding)."""
    from goodput_ckpt.format.grid import GridChunks
    from goodput_ckpt.format.parse import parse_manifest

    data = Path(path, "manifest.json").read_bytes()
    m = parse_manifest(data)
    runs = sum(len(e.chunks.runs) for e in m.items.values() if isinstance(getattr(e, "chunks", None), GridChunks))
    return {"bytes": len(data), "grid_runs": runs, "data_bytes": sum(f.size for f in m.files.values())}


def reparse(paths: list[str], repeats: int) -> list[dict]:
    """``read_metadata`` of kept checkpoints (``--keep``) in this one process, interleaved: the
    per-rank work without 2 cores shared by W ranks (CPU seconds, min/median/max of ``repeats``)."""
    from goodput_ckpt import CheckpointReader

    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for path in paths:
            times[path].append(_time(lambda path=path: CheckpointReader(path).read_metadata())[0])
    return [{"path": p, "cpu_s": _spread(v[1:]), **_record(p)} for p, v in times.items()]


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(world: int, layers: int, repeats: int, old: bool, out: str, keep: str | None = None) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(
            _rank,
            args=(world, root, _free_port(), layers, repeats, old, out, keep),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
    ranks = [json.loads(Path(out, f"w{world}_r{r}.json").read_text()) for r in range(world)]
    fig: dict = {"world": world, "items": ranks[0]["items"], "chunks": ranks[0]["chunks"]}
    for which in ("new", "old") if old else ("new",):
        fig[which] = {"record": ranks[0][which]["record"]}
        for mode in ("alone", "together"):
            for k, what in enumerate(("cpu_s", "wall_s", "thread_cpu_s")):
                worst = [max(ranks[r][which][mode][i][k] for r in range(world)) for i in range(repeats)]
                fig[which][f"{mode}_{what}"] = _spread(worst)
        cpu = [statistics.median(x[0] for x in ranks[r][which]["alone"]) for r in range(world)]
        fig[which]["worst_rank"] = max(range(world), key=cpu.__getitem__)
        # Each rank's median over the repeats: the worst of W noisy figures grows with W by
        # itself (the maximum of more draws), these show whether any rank's work does.
        fig[which]["alone_cpu_s_rank_medians"] = cpu
        fig[which]["alone_thread_cpu_s_rank_medians"] = [
            statistics.median(x[2] for x in ranks[r][which]["alone"]) for r in range(world)
        ]
    return fig


def _fmt(spread: dict[str, float]) -> str:
    return f"{spread['min']:.3f}/{spread['median']:.3f}/{spread['max']:.3f}"


def _top(prof: str, n: int = 12) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=600, help="nn.Linear layers: 4 items each with AdamW, x2")
    ap.add_argument("--old-layout", action="store_true", help="also save and time the byte layout before the fix")
    ap.add_argument("--profile", action="store_true", help="print the worst rank's top functions per W")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", help="save the checkpoints under this directory (w<W>) and keep them")
    ap.add_argument("--reparse", nargs="+", help="only time read_metadata of these kept checkpoints in one process")
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    if args.reparse:
        rows = reparse(args.reparse, args.repeats)
        for row in rows:
            print(f"{row['path']}: CPU {_fmt(row['cpu_s'])} s (min/median/max), {row['grid_runs']} grid runs")
        print(f"load average at end: {os.getloadavg()}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"load_average_end": os.getloadavg(), "reparse": rows}, indent=1))
        return 0
    figures = []
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            sub = os.path.join(out, f"w{world}")
            os.makedirs(sub)
            keep = args.keep and os.path.join(args.keep, f"w{world}")
            fig = run(world, args.layers, args.repeats, args.old_layout, sub, keep)
            figures.append(fig)
            print(
                f"W={world:2d}: items {fig['items']}, chunks {fig['chunks']}",
                flush=True,
            )
            for which in ("new", "old") if args.old_layout else ("new",):
                f = fig[which]
                rec = f["record"]
                print(
                    f"  {which}: record {rec['bytes']} B, {rec['grid_runs']} grid runs, data {rec['data_bytes']} B; "
                    f"worst rank alone CPU {_fmt(f['alone_cpu_s'])} s, wall {_fmt(f['alone_wall_s'])} s; "
                    f"together CPU {_fmt(f['together_cpu_s'])} s, wall {_fmt(f['together_wall_s'])} s "
                    f"(min/median/max of {args.repeats}); alone thread CPU {_fmt(f['alone_thread_cpu_s'])} s",
                    flush=True,
                )
                for k in ("cpu_s", "thread_cpu_s"):
                    print(f"    rank medians, alone {k}: " + " ".join(f"{v:.4f}" for v in f[f"alone_{k}_rank_medians"]))
                if args.profile:
                    print(_top(os.path.join(sub, f"w{world}_{which}_r{f['worst_rank']}.prof")), flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average_end": os.getloadavg(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
