"""Multi-rank saves and loads on ``s3://`` against SeaweedFS, on real gloo processes.

One 3-rank group runs everything (starting a group costs 10-30 s on 2 cores):

- ranks 0 and 1 save DTensors sharded over a 2-rank mesh, with ``dcp.save`` and with
  ``dcp.async_save`` through both executors (the process executor pickles the writer into a
  background process), the state mutated right after the call returns, on their own subgroup;
- all 3 ranks load both checkpoints resharded (``Shard(1)``, ``Shard(0)``, ``Replicate()``) and
  compare with the full reference tensors;
- the manifest is read once per load, by rank 0, and broadcast: a counting proxy in front of the
  server sees one ``GetObject`` of the manifest (and one size check per data file) per load, where
  ``share_manifest=False`` makes every rank read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks
from helpers.s3 import FaultProxy, proxy_counts

from goodput_ckpt import CheckpointReader, CheckpointWriter

pytestmark = pytest.mark.multiproc

CHUNK = 5 << 20


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {
        "w": torch.randn(1536, 1024, generator=g),  # 6 MiB: more than one part per rank
        "h": torch.randn(1000, 1537, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (999, 7), generator=g),
        "tiny": torch.randn(2, 3, generator=g),  # empty shards on some ranks
    }


LOAD_PLACEMENTS = {"w": "shard1", "h": "shard0", "ids": "replicate", "tiny": "shard0"}


def _placement(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[kind]


def _manifest_reads(proxy_url: str, prefix: str) -> tuple[int, int, int]:
    """Manifest GETs, data-file HEADs and listings so far (sizes come from one listing of the
    location, issue 37; the proxy sees a listing's prefix only in its query, so listings are
    counted bucket-wide: between the barriers only the load lists)."""
    counts = proxy_counts(proxy_url)
    gets = sum(n for (op, key), n in counts.items() if op == "GetObject" and key == f"{prefix}/manifest.json")
    heads = sum(n for (op, key), n in counts.items() if op == "HeadObject" and key.startswith(f"{prefix}/rank"))
    lists = sum(n for (op, _), n in counts.items() if op == "ListObjects")
    return gets, heads, lists


def _worker(rank: int, world_size: int, proxy_url: str, bucket: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert world_size == 3
    opts = {"endpoint_url": proxy_url, "addressing_style": "path", "region": "us-east-1"}
    full = reference()

    # -- 2-rank saves (ranks 0 and 1; rank 2 waits) ------------------------------------------
    pair_mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it; rank 2 is not a member
    if rank < 2:
        pair = pair_mesh.get_group()

        def fresh() -> dict:
            return {
                "dt": {k: distribute_tensor(v, pair_mesh, [Shard(0)]) for k, v in full.items()},
                "extra": {"step": 7},
            }

        dcp.save(
            fresh(),
            storage_writer=CheckpointWriter(f"s3://{bucket}/sync", chunk_size=CHUNK, **opts),
            process_group=pair,
        )
        for prefix, kind in (("async", AsyncCheckpointerType.THREAD), ("async_process", AsyncCheckpointerType.PROCESS)):
            sd = fresh()
            writer = CheckpointWriter(f"s3://{bucket}/{prefix}", chunk_size=CHUNK, **opts)
            fut = dcp.async_save(sd, storage_writer=writer, process_group=pair, async_checkpointer_type=kind)
            for t in sd["dt"].values():
                t.to_local().add_(1)  # training goes on: the checkpoint must not see this
            sd["extra"]["step"] = 8
            fut.result(timeout=180)
    dist.barrier()

    # -- 3-rank loads, resharded -------------------------------------------------------------
    mesh = init_device_mesh("cpu", (world_size,))
    for prefix in ("sync", "async", "async_process"):
        target = {
            "dt": {
                k: distribute_tensor(torch.zeros_like(v), mesh, [_placement(LOAD_PLACEMENTS[k])])
                for k, v in full.items()
            },
            "extra": {"step": -1},
        }
        before = _manifest_reads(proxy_url, prefix) if rank == 0 else None
        dist.barrier()
        dcp.load(target, storage_reader=CheckpointReader(f"s3://{bucket}/{prefix}", **opts))
        dist.barrier()
        if rank == 0:
            after = _manifest_reads(proxy_url, prefix)
            assert tuple(a - b for a, b in zip(after, before)) == (1, 0, 1), (
                f"{prefix}: (manifest GETs, HEADs, listings) {after} - {before} for one 3-rank load"
            )
        assert target["extra"]["step"] == 7, prefix
        for k, v in target["dt"].items():
            assert v.placements == (_placement(LOAD_PLACEMENTS[k]),), k
            assert torch.equal(v.full_tensor(), full[k]), f"{prefix}: {k} differs after a 2 -> 3 rank reshard"

    # Without sharing, every rank reads the manifest (and checks the sizes) itself.
    before = _manifest_reads(proxy_url, "sync") if rank == 0 else None
    dist.barrier()
    target = {"dt": {"w": torch.zeros(1536, 1024)}}
    dcp.load(target, storage_reader=CheckpointReader(f"s3://{bucket}/sync", share_manifest=False, **opts))
    dist.barrier()
    assert torch.equal(target["dt"]["w"], full["w"])
    if rank == 0:
        after = _manifest_reads(proxy_url, "sync")
        assert tuple(a - b for a, b in zip(after, before)) == (3, 0, 3), (after, before)


def test_two_rank_save_three_rank_load(seaweed_server, tmp_path: Path):
    proxy = FaultProxy(seaweed_server.url)  # no faults: it counts requests
    try:
        import boto3

        bucket = "goodput-multirank"
        boto3.client("s3", endpoint_url=seaweed_server.url, region_name="us-east-1").create_bucket(Bucket=bucket)
        run_ranks(_worker, 3, proxy.url, bucket, report_dir=tmp_path / "ranks", timeout=300)
    finally:
        proxy.stop()
