"""``bench_scale_save.py --check``: the bytes ``dcp.save`` exchanges on real gloo ranks against the simulation.

Real processes (8 by default) save the ``tiny`` layout, nested as ``bench_scale_save.state_dict``
builds it but with real DTensors ``Shard(0)`` and real AdamW ``step`` tensors, twice, through
``dcp.save``: once with ``ReplicaGroupingSavePlanner`` + ``SavePlanCache`` + ``CheckpointWriter``
(``ours``), once with ``DefaultSavePlanner`` + ``FileSystemWriter`` (``torch``). Each rank counts
what DCP pickles around the planner and writer (its local plan as the writer hands it to the
gather, its write results; on the coordinator the plans the writer hands to the scatter and the
``Metadata`` result) and its CPU seconds in
``create_local_plan``. The same figures from ``bench_scale_save``'s simulation of the same layout
and W are printed beside them: the bytes must agree within 1% (the writer's random token and
``storage_meta`` are the only differences).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_state(mesh, world: int) -> dict:
    from bench_scale_save import state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if type(v).__name__ == "SimShard":
            return distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), mesh, [Shard(0)], src_data_rank=None)
        return v

    return walk(state_dict("tiny", 0, world))


def _save_rank(rank: int, world: int, root: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    from goodput_ckpt import CheckpointWriter
    from goodput_ckpt.dcp.plan_cache import SavePlanCache
    from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts: dict[str, int | float] = {}

    def counting(base):
        class Counting(base):
            def create_local_plan(self):
                t0 = time.process_time()
                plan = super().create_local_plan()
                counts[f"{self._tag} local plan cpu s"] = time.process_time() - t0
                return plan

        return Counting

    def writer_counting(base):
        # The plans as dcp.save's gather and scatter pickle them: after the writer's steps
        # (the scattered plans carry the writer's storage data, the file names).
        class Counting(base):
            def prepare_local_plan(self, plan):
                plan = super().prepare_local_plan(plan)
                counts[f"{self._tag} plans gathered"] = len(pickle.dumps(plan))
                return plan

            def prepare_global_plan(self, plans):
                plans = super().prepare_global_plan(plans)
                counts[f"{self._tag} plans scattered"] = sum(len(pickle.dumps(p)) for p in plans)
                return plans

            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                counts[f"{self._tag} results gathered"] = len(pickle.dumps(fut.wait()))
                return fut

        return Counting

    try:
        mesh = init_device_mesh("cpu", (world,))
        cache = SavePlanCache()
        for save in (1, 2):
            for method in ("ours", "torch"):
                tag = f"{method} {save}"
                if method == "ours":
                    planner, writer = (
                        counting(ReplicaGroupingSavePlanner)(plan_cache=cache),
                        writer_counting(CheckpointWriter)(f"{root}/{tag}"),
                    )
                else:
                    planner, writer = counting(DefaultSavePlanner)(), writer_counting(FileSystemWriter)(f"{root}/{tag}")
                planner._tag = writer._tag = tag
                md = dcp.save(_real_state(mesh, world), storage_writer=writer, planner=planner)
                counts[f"{tag} Metadata broadcast"] = len(pickle.dumps(md)) if rank == 0 else 0
        Path(root, f"counts-{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def run_check(world: int = 8) -> int:
    import torch.multiprocessing as mp
    from bench_scale_save import measure

    with tempfile.TemporaryDirectory(prefix="bench-save-check-") as root:
        mp.start_processes(_save_rank, args=(world, root, _free_port()), nprocs=world, start_method="spawn", join=True)
        ranks = [json.loads(Path(root, f"counts-{r}.json").read_text()) for r in range(world)]
    real = {k: sum(c.get(k, 0) for c in ranks) for k in ranks[0] if "cpu" not in k}
    failures = 0
    print(f"--check: the 'tiny' layout on {world} real gloo ranks vs the simulation (bytes; sum over ranks)")
    for method in ("ours", "torch"):
        sim = measure(method, "tiny", world, 1, False)
        for save in (1, 2):
            for payload in ("plans gathered", "plans scattered", "results gathered", "Metadata broadcast"):
                r, s = real[f"{method} {save} {payload}"], sim["saves"][save]["bytes"][payload]
                ok = abs(r - s) <= max(0.01 * r, 64)
                failures += not ok
                print(
                    f"  {method:<6} save {save} {payload:<19} real {r:>10,}  simulated {s:>10,}  {'ok' if ok else 'DIFFERS'}"
                )
            cpu = [c[f"{method} {save} local plan cpu s"] for c in ranks]
            print(
                f"  {method:<6} save {save} create_local_plan cpu s, real ranks 0/1/{world // 2}: "
                f"{cpu[0]:.4f} / {cpu[1]:.4f} / {cpu[world // 2]:.4f}; simulated: "
                + " / ".join(
                    f"{v['local plan']:.4f}"
                    for v in [
                        sim["saves"][save][f"{w} phases cpu s"] for w in ("coordinator", "rank 1", f"rank {world // 2}")
                    ]
                )
            )
    return 1 if failures else 0
