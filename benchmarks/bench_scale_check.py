"""``bench_scale.py --check``: the real save path on 2-16 gloo ranks against the simulation.

For each world size, real processes save the ``tiny`` layout (bench_scale's Llama shapes, scaled
down; FSDP ``Shard(0)`` DTensors) through ``dcp.save`` and ``CheckpointWriter``. The manifest
they commit is compared with the one ``bench_scale`` builds for the same layout from simulated
``finish`` inputs: every item's shape, dtype, grid block and runs, every file's size, and the
record's size in bytes (the two differ only in the data files' digests, which the simulation
invents, the save token and ``dcp.storage_meta``). Then it times reading each real record
(``parse_manifest``), and the same record written as version 1 of the format did, in rounds that rotate their
order, and prints each against the 2-rank one per round (min / median / max): the issue-19
acceptance figure.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest

PARSE_REPEATS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_rank(rank: int, world: int, path: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from bench_scale import CHUNK_SIZE, model_tensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from goodput_ckpt import CheckpointWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = {
            t.fqn: distribute_tensor(
                torch.zeros(t.shape, dtype=getattr(torch, t.dtype)), mesh, [Shard(0)], src_data_rank=None
            )
            for t in model_tensors("tiny")
        }
        dcp.save(sd, storage_writer=CheckpointWriter(path, chunk_size=CHUNK_SIZE, thread_count=1))
    finally:
        dist.destroy_process_group()


def _simulated(world: int) -> bytes:
    from bench_scale import CHUNK_SIZE, simulate

    from goodput_ckpt.dcp.commit_build import build_manifest

    sim = simulate("tiny", world, "fsdp", 0)
    m = build_manifest(
        sim.metadata, sim.results, chunk_size=CHUNK_SIZE, created_at="2026-01-01T00:00:00Z", user_metadata={}
    )
    return m.to_json()


def _shape_of(raw: bytes) -> tuple[list, list]:
    m = parse_manifest(raw)
    items = []
    for key, e in m.items.items():
        runs = getattr(e.chunks, "runs", None)
        block = getattr(e.chunks, "block", None)
        items.append((key, e.dtype, e.shape, block, runs))
    return items, [f.size for f in m.files.values()]


def run_check(worlds: list[int]) -> int:
    import dataclasses

    import torch.multiprocessing as mp

    failures = 0
    records: dict[tuple[str, int], bytes] = {}
    print(f"--check: real gloo saves of the 'tiny' layout vs the simulation, worlds {worlds}")
    with tempfile.TemporaryDirectory(prefix="bench-scale-check-") as tmp:
        for world in worlds:
            path = str(Path(tmp, f"w{world}"))
            mp.start_processes(
                _save_rank, args=(world, path, _free_port()), nprocs=world, start_method="spawn", join=True
            )
            real = Path(path, MANIFEST_NAME).read_bytes()
            sim = _simulated(world)
            same = _shape_of(real) == _shape_of(sim)
            failures += not same
            records["v2", world] = real
            # The same checkpoint's record as version 1 of the format wrote it (every chunk listed).
            records["v1", world] = dataclasses.replace(parse_manifest(real), version=1).to_json()
            print(
                f"  W={world:>2}: items and files {'match' if same else 'DIFFER'}; record {len(real):,} bytes real, "
                f"{len(sim):,} simulated ({len(real) - len(sim):+,}); as v1: {len(records['v1', world]):,} bytes"
            )
    # Reading each record (parse_manifest: every check), in rounds that take every record once in
    # a rotating order, so that the machine's drift hits all of them alike; ratios per round.
    keys = list(records)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
    for r in range(PARSE_REPEATS):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.perf_counter()
            parse_manifest(records[k])
            times[k].append(time.perf_counter() - t0)
    for version in ("v1", "v2"):
        base = times[version, worlds[0]]
        for world in worlds[1:]:
            ratios = sorted(t / b for t, b in zip(times[version, world], base))
            print(
                f"  {version} read W={world} vs W={worlds[0]}: median {statistics.median(ratios):.2f}x "
                f"(per-round min {ratios[0]:.2f}, max {ratios[-1]:.2f}; {statistics.median(times[version, world]) * 1e3:.1f} "
                f"vs {statistics.median(base) * 1e3:.1f} ms, {PARSE_REPEATS} rounds)"
            )
    return 1 if failures else 0
