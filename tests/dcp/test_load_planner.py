"""GridLoadPlanner: the reads it computes from a v2 grid are exactly torch's, and loads through it
are bit-exact, resharded ones included. (Its speed is in benchmarks/bench_scale.py, not timed here.)
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from goodput_ckpt import CheckpointReader, CheckpointWriter, GridLoadPlanner
from goodput_ckpt.dcp.load_planner import grid_read_items, tensor_read_items
from goodput_ckpt.format.dcp_metadata import _GridChunkList, grid_of, to_dcp_metadata
from goodput_ckpt.format.grid import GridChunks
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest


def _key(item) -> tuple:
    return (
        item.type,
        item.dest_index.fqn,
        tuple(item.dest_index.offset),
        item.dest_index.index,
        tuple(item.dest_offsets),
        item.storage_index.fqn,
        tuple(item.storage_index.offset),
        item.storage_index.index,
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> GridChunks:
    cells = math.prod(-(-s // b) for s, b in zip(shape, block))
    return GridChunks(shape, block, 4, ((cells, 0, 1, 0),), [f"f{i}" for i in range(cells)])


def _random_boxes(rng: random.Random, shape: tuple[int, ...], n: int) -> list[ChunkStorageMetadata]:
    boxes = []
    for _ in range(n):
        lo = [rng.randrange(0, s) for s in shape]
        size = [rng.randrange(0, s - o + 1) for o, s in zip(lo, shape)]  # empty boxes included
        boxes.append(ChunkStorageMetadata(offsets=torch.Size(lo), sizes=torch.Size(size)))
    return boxes


@pytest.mark.parametrize(
    "shape,block",
    [((10,), (4,)), ((10,), (10,)), ((37, 5), (10, 5)), ((37, 5), (37, 2)), ((9, 8, 7), (4, 3, 7)), ((6, 12), (2, 5))],
)
def test_grid_reads_equal_torchs(shape, block) -> None:
    grid = _grid(shape, block)
    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape), chunks=_GridChunkList(grid)
    )
    rng = random.Random(hash((shape, block)) & 0xFFFF)
    for trial in range(40):
        local = _random_boxes(rng, shape, 1 + trial % 3)
        ours = sorted(map(_key, grid_read_items("w", grid, local)))
        theirs = sorted(_key(i) for i in create_read_items_for_chunk_list("w", md, local) if math.prod(i.lengths))
        assert ours == theirs, (shape, block, local)


def test_explicit_chunks_go_through_torchs_sweep() -> None:
    grid = _grid((37, 5), (10, 5))
    listed = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size((37, 5)), chunks=list(_GridChunkList(grid))
    )
    gridded = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size((37, 5)), chunks=_GridChunkList(grid)
    )
    local = _random_boxes(random.Random(3), (37, 5), 4)
    assert grid_of(listed.chunks) is None and grid_of(gridded.chunks) is grid
    want = sorted(_key(i) for i in create_read_items_for_chunk_list("w", listed, local) if math.prod(i.lengths))
    assert sorted(_key(i) for i in tensor_read_items("w", listed, local) if math.prod(i.lengths)) == want
    assert sorted(map(_key, tensor_read_items("w", gridded, local))) == want


def test_grid_reads_refuse_a_box_outside_the_shape() -> None:
    box = ChunkStorageMetadata(offsets=torch.Size([8]), sizes=torch.Size([4]))
    with pytest.raises(ValueError, match="outside the saved shape"):
        grid_read_items("w", _grid((10,), (4,)), [box])


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(23)
    return {f"l{i}.w": torch.randn(5 + i % 13, 3 + i % 4, generator=g) for i in range(24)}


def _save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in reference().items()}
    dcp.save(sd, storage_writer=CheckpointWriter(path, chunk_size=1 << 12))


def _load_resharded(rank: int, world: int, path: str, placement: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dim = 0 if placement == "shard0" else 1
    ref = reference()
    # src_data_rank=None: each rank cuts its shard locally, so the only collectives are dcp.load's
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(dim)], src_data_rank=None) for k, v in ref.items()}
    planner = GridLoadPlanner()
    dcp.load(sd, storage_reader=CheckpointReader(path), planner=planner)
    assert grid_of(planner.metadata.state_dict_metadata["l0.w"].chunks) is not None  # the grid path ran
    for k, v in ref.items():
        want = distribute_tensor(v, mesh, [Shard(dim)], src_data_rank=None).to_local()
        assert torch.equal(sd[k].to_local(), want), k


def _load_resharded_both(rank: int, world: int, path: str) -> None:
    """Both placements in one gloo job (a process group costs 10-30 s to start on 2 cores)."""
    _load_resharded(rank, world, path, "shard0")
    _load_resharded(rank, world, path, "shard1")


@pytest.fixture(scope="module")
def saved_on_3_ranks(tmp_path_factory) -> str:
    """A checkpoint of ``reference()`` sharded on 3 gloo ranks; read-only for the tests."""
    where = tmp_path_factory.mktemp("load_planner")
    path = str(where / "ck")
    run_ranks(_save, 3, path, timeout=300, report_dir=where / "save")
    return path


@pytest.mark.multiproc
def test_resharded_loads_through_the_planner_are_bit_exact(saved_on_3_ranks: str, tmp_path: Path) -> None:
    path = saved_on_3_ranks
    m = parse_manifest((Path(path) / MANIFEST_NAME).read_bytes())
    assert isinstance(m.items["l0.w"].chunks, GridChunks)
    run_ranks(_load_resharded_both, 2, path, timeout=300, report_dir=tmp_path / "load2")
    # one process, plain tensors: the whole plan, compared item by item with torch's planner
    dest = {k: torch.zeros_like(v) for k, v in reference().items()}
    md = to_dcp_metadata(m)
    plans = []
    for planner in (GridLoadPlanner(), DefaultLoadPlanner()):
        planner.set_up_planner(dest, metadata=md, is_coordinator=True)
        sent = planner.create_local_plan()  # what dcp.load gathers on the coordinator
        if isinstance(planner, GridLoadPlanner):
            assert sent.items == []  # the read items stay on their rank
        plans.append(sorted(map(_key, planner.finish_plan(sent).items)))
    assert plans[0] == plans[1] and len(plans[0]) == 3 * len(dest)  # each tensor from 3 saved shards
    dcp.load(dest, storage_reader=CheckpointReader(path), planner=GridLoadPlanner(), no_dist=True)
    assert all(torch.equal(dest[k], v) for k, v in reference().items())


def _fails_with(match: str, dest: dict, path: str) -> None:
    with pytest.raises(CheckpointException) as info:  # dcp.load wraps the planner's error per rank
        dcp.load(dest, storage_reader=CheckpointReader(path), planner=GridLoadPlanner(), no_dist=True)
    assert match in " ".join(map(str, info.value.failures.values()))


def test_planner_refuses_missing_keys_and_shape_changes(saved_on_3_ranks: str) -> None:
    path = saved_on_3_ranks
    dest = {k: torch.zeros_like(v) for k, v in reference().items()}
    dest["extra"] = torch.zeros(2)
    _fails_with("the checkpoint has no extra (1 key(s) this state dict expects)", dest, path)
    del dest["extra"]
    dest["l0.w"] = torch.zeros(2, 2)
    _fails_with("l0.w: saved float32 (", dest, path)  # the cause in one line (tests/dcp/test_state_fit.py)
    dest = {"l1.w": torch.zeros_like(reference()["l1.w"])}
    dcp.load(
        dest, storage_reader=CheckpointReader(path), planner=GridLoadPlanner(allow_partial_load=True), no_dist=True
    )
    assert torch.equal(dest["l1.w"], reference()["l1.w"])
