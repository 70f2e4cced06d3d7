"""The coordinator reuses the last save's item entries when no rank's layout changed
(commit_build._LastLayout): the reused record names the new files and loads bit-exact, and any
change of layout (sharding, shape, an object's length) builds the entries afresh.
(The time it saves is in benchmarks/bench_scale.py, not timed here.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.dcp import commit_build
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest
from goodput_ckpt.tools.ops.verify import verify_checkpoint


def _state(seed: int, note: str = "x") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(12, 6, generator=g),
        "b": torch.randn(7, generator=g),
        "n": torch.tensor(seed),
        "note": note,
    }


def _load(path: Path, like: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    dcp.load(out, storage_reader=CheckpointReader(path), no_dist=True)
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b)


def test_a_later_save_reuses_the_entries_with_its_own_files(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    before = commit_build._last_layout.reused
    for i in range(3):
        dcp.save(_state(i), storage_writer=CheckpointWriter(tmp_path / f"s{i}"), no_dist=True)
    assert commit_build._last_layout.reused == before + 2
    first = parse_manifest((tmp_path / "s0" / MANIFEST_NAME).read_bytes())
    for i in (1, 2):
        m = parse_manifest((tmp_path / f"s{i}" / MANIFEST_NAME).read_bytes())
        assert set(m.files).isdisjoint(first.files)  # a save's own files, not the first save's
        assert {e.file for e in m.items.values() if e.kind == "object"} <= set(m.files)
        assert _same(_load(tmp_path / f"s{i}", _state(i)), _state(i))
        assert verify_checkpoint(str(tmp_path / f"s{i}")).ok


def test_an_object_of_another_length_builds_afresh(tmp_path: Path) -> None:
    commit_build.forget_layouts()
    dcp.save(_state(1), storage_writer=CheckpointWriter(tmp_path / "a"), no_dist=True)
    before = commit_build._last_layout.reused
    longer = _state(2, note="x" * 5000)  # torch.save pads short strings to one length
    dcp.save(longer, storage_writer=CheckpointWriter(tmp_path / "b"), no_dist=True)
    assert commit_build._last_layout.reused == before
    assert _same(_load(tmp_path / "b", longer), longer)


def _save_both_shardings(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(4)
    full = {"w": torch.randn(8, 8, generator=g), "v": torch.randn(6, 10, generator=g)}
    # same shapes, dtypes and per-rank byte counts: only the sharding differs between the saves
    for i, dim in enumerate((0, 0, 1)):
        sd = {k: distribute_tensor(v, mesh, [Shard(dim)], src_data_rank=None) for k, v in full.items()}
        dcp.save(sd, storage_writer=CheckpointWriter(f"{root}/s{i}"))
    if rank == 0:
        assert commit_build._last_layout.reused == 1  # s1 reused s0's entries; s2 did not


@pytest.mark.multiproc
def test_another_sharding_with_the_same_sizes_builds_afresh(tmp_path: Path) -> None:
    run_ranks(_save_both_shardings, 2, str(tmp_path), timeout=300, report_dir=tmp_path / "ranks")
    g = torch.Generator().manual_seed(4)
    full = {"w": torch.randn(8, 8, generator=g), "v": torch.randn(6, 10, generator=g)}
    for i, block in enumerate(((4, 8), (4, 8), (8, 4))):
        m = parse_manifest((tmp_path / f"s{i}" / MANIFEST_NAME).read_bytes())
        assert m.items["w"].chunks.block == block
        assert _same(_load(tmp_path / f"s{i}", full), full)
