"""Format v2 at several world sizes: the same many-tensor state saved by 2 and by 8 gloo ranks
loads bit-exact from both, with every sharded tensor stored as one grid entry (so the commit
record does not grow with the ranks; its cost is measured in benchmarks/bench_scale.py, not
timed here). And a v1 checkpoint, written by the v1 serializer, still loads and verifies.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.format.grid import GridChunks
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest
from goodput_ckpt.tools.ops.verify import verify_checkpoint

TENSORS = 120


def reference() -> dict[str, torch.Tensor]:
    """Many tensors of uneven first dimensions (some shorter than 8: empty shards on 8 ranks)."""
    g = torch.Generator().manual_seed(19)
    out = {}
    for i in range(TENSORS):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        t = torch.randn(3 + i % 29, 4 + i % 5, generator=g) * 100
        out[f"layers.{i}.w"] = t.to(dtype)
    return out


def _save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in reference().items()}
    sd["step"] = 7
    dcp.save(sd, storage_writer=CheckpointWriter(path, chunk_size=1 << 12))


def _save_with_rank_keys(rank: int, world: int, path: str, report: str) -> None:
    """A save like a training job's: shards, plus per-rank tensors under keys that name the rank
    and replicated scalars; the coordinator reports the member count of each group of ranks
    its commit build formed."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from goodput_ckpt.dcp import item_entries

    built = item_entries._Rows.__init__

    def init(self, metadata, ranks):  # type: ignore[no-untyped-def]
        built(self, metadata, ranks)
        Path(report).write_text(json.dumps([len(g.tables) for g in self.groups]))

    item_entries._Rows.__init__ = init
    mesh = init_device_mesh("cpu", (world,))
    sd: dict = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in reference().items()}
    sd[f"rng.rank{rank}.torch"] = torch.full((5,), rank, dtype=torch.uint8)
    sd["optim.step"] = torch.tensor(3.0)
    sd["step"] = 7
    dcp.save(sd, storage_writer=CheckpointWriter(path, chunk_size=1 << 12))


@pytest.mark.slow
def test_per_rank_keys_leave_the_ranks_in_one_group(tmp_path: Path) -> None:
    world = 4
    report = tmp_path / "groups.json"
    run_ranks(
        _save_with_rank_keys, world, str(tmp_path / "ckpt"), str(report), timeout=600, report_dir=tmp_path / "report"
    )
    # one group of every rank's shards, then each rank's own items (rank 0: also the replicated ones)
    assert json.loads(report.read_text()) == [world] + [1] * world
    m = parse_manifest((tmp_path / "ckpt" / MANIFEST_NAME).read_bytes())
    assert all(isinstance(m.items[k].chunks, GridChunks) for k in reference())
    ref = reference()
    out = {k: torch.zeros_like(v) for k, v in ref.items()}
    out |= {f"rng.rank{r}.torch": torch.zeros(5, dtype=torch.uint8) for r in range(world)}
    dcp.load(out, storage_reader=CheckpointReader(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ref.items())
    assert [int(out[f"rng.rank{r}.torch"][0]) for r in range(world)] == list(range(world))


def _load_plain(path: Path) -> dict[str, torch.Tensor]:
    ref = reference()
    out = {k: torch.zeros_like(v) for k, v in ref.items()}
    out["step"] = 0
    dcp.load(out, storage_reader=CheckpointReader(path), no_dist=True)
    return out


@pytest.mark.slow
def test_two_and_eight_ranks_store_grids_and_load_bit_exact(tmp_path: Path) -> None:
    ref = reference()
    for world in (2, 8):
        path = tmp_path / f"w{world}"
        run_ranks(_save, world, str(path), timeout=600, report_dir=tmp_path / f"report{world}")
        m = parse_manifest((path / MANIFEST_NAME).read_bytes())
        assert m.version == 2 and m.world_size == world
        grids = [e for k, e in m.items.items() if k != "step"]
        assert all(isinstance(e.chunks, GridChunks) for e in grids)
        # One run per tensor when every shard sits at the same offset of its rank's file.
        assert max(len(e.chunks.runs) for e in grids) <= world
        loaded = _load_plain(path)
        assert loaded["step"] == 7
        for k, v in ref.items():
            assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
        assert verify_checkpoint(str(path)).status == "ok"


def test_v1_checkpoint_still_loads_and_verifies(tmp_path: Path) -> None:
    ref = reference()
    dcp.save(dict(ref, step=7), storage_writer=CheckpointWriter(tmp_path, chunk_size=1 << 12), no_dist=True)
    v2 = parse_manifest((tmp_path / MANIFEST_NAME).read_bytes())
    # The v1 serializer (Manifest.to_json with version 1 lists every chunk), as the code before v2 wrote it.
    raw = dataclasses.replace(v2, version=1).to_json()
    assert b'"version":1,' in raw and b'"grid"' not in raw
    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    m = parse_manifest(raw)
    assert m.version == 1 and not any(isinstance(e.chunks, GridChunks) for k, e in m.items.items() if k != "step")
    loaded = _load_plain(tmp_path)
    assert loaded["step"] == 7
    for k, v in ref.items():
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
    assert verify_checkpoint(str(tmp_path)).status == "ok"
