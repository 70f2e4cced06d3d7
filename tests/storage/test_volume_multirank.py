"""A 2-rank gloo save onto the strict FUSE mount (rclone over SeaweedFS), direct and staged.

One process group runs both saves (starting a group costs 10-30 s on 2 cores):

- a direct save: each rank writes its own files on the mount, the coordinator the manifest;
- a staged save (both ranks stage in one local directory): ``dcp.save`` returns after the local
  write, every rank uploads its own files in the background, and the coordinator writes the
  manifest only once it has seen the other rank's upload markers. Each rank's
  ``durable_future()`` completes; then the manifest is on the volume.

Both checkpoints are loaded by the two ranks with another sharding, and by the test process
into plain tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.format.manifest import MANIFEST_NAME

pytestmark = pytest.mark.multiproc


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(2048, 1024, generator=g),  # 8 MiB: a chunk per rank
        "h": torch.randn(999, 257, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (301, 3), generator=g),
        "tiny": torch.randn(1, 3, generator=g),  # an empty shard on rank 1
    }


def _worker(rank: int, world_size: int, direct: str, staged: str, stage_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = reference()
    sd = {"dt": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, "extra": {"step": 5}}

    writer = CheckpointWriter(direct)
    dcp.save(sd, storage_writer=writer)
    assert writer.durable_future().done()

    writer = CheckpointWriter(staged, stage_dir=stage_dir)
    dcp.save(sd, storage_writer=writer)
    writer.durable_future().result(timeout=180)
    dist.barrier()
    assert os.path.exists(os.path.join(staged, MANIFEST_NAME)), "every rank's durable future is done: committed"

    for loc in (direct, staged):
        target = {
            "dt": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()},
            "extra": {"step": -1},
        }
        dcp.load(target, storage_reader=CheckpointReader(loc))
        assert target["extra"]["step"] == 5
        for k, v in target["dt"].items():
            assert torch.equal(v.full_tensor(), full[k]), f"{loc}: {k}"


def test_two_rank_saves_on_a_strict_mount(rclone_volume, tmp_path: Path):
    direct, staged = rclone_volume.fresh("mr-direct"), rclone_volume.fresh("mr-staged")
    stage_dir = tmp_path / "stage"
    run_ranks(_worker, 2, str(direct), str(staged), str(stage_dir), report_dir=tmp_path / "ranks", timeout=240)
    for loc in (direct, staged):
        names = os.listdir(loc)
        assert sorted(n[:9] for n in names if n.endswith(".bin")) == ["rank00000"] * 4 + ["rank00001"] * 4, names
        assert not [n for n in names if n.endswith(".uploaded")], names
        full = reference()
        dest = {"dt": {k: torch.zeros_like(v) for k, v in full.items()}, "extra": {"step": -1}}
        dcp.load(dest, storage_reader=CheckpointReader(loc))
        assert dest["extra"]["step"] == 5
        for k in full:
            assert torch.equal(dest["dt"][k], full[k]), f"{loc}: {k}"
    assert not any(stage_dir.rglob("*.bin")), "the staged files were uploaded and removed"
