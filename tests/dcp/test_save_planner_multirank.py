"""``drop_empty_shards`` (dcp/save_planner.py) on a real 4-rank gloo group: what it drops never
costs a byte of the checkpoint.

FSDP2 gives every rank past a tensor's end an empty ``Shard(0)`` shard. The planner drops those
before torch's dedup (so the ranks' key lists stay alike and the commit record's rank groups
stay few). Here a state of DTensors ``Shard(0)`` over 4 ranks, several with fewer rows than ranks
(1, 2 and 3 rows) and uneven ones (5 and 6 rows: the last non-empty shard is short), plus a
tensor with no element at all (its empty shards are its only record, so they are kept) and a
replicated scalar, is saved through ``ReplicaGroupingSavePlanner`` and ``CheckpointWriter``.
The final plans each rank writes must hold no empty shard of a non-empty tensor (the part that
fails without the drop). The checkpoint then loads bit-exact at 4 ranks (torch's
``DefaultLoadPlanner``), at 3 ranks (``GridLoadPlanner``, as ``CheckpointManager`` loads) and
at 1 rank without a process group, into plain tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.dcp.load_planner import GridLoadPlanner
from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner

WORLD = 4
#: (rows, columns, dtype) of each sharded tensor: fewer rows than ranks, uneven, even, none.
SHAPES = {
    "one_row": (1, 3, torch.float32),
    "two_rows": (2, 5, torch.bfloat16),
    "three_rows": (3, 2, torch.float32),
    "five_rows": (5, 3, torch.float64),
    "six_rows": (6, 4, torch.int64),
    "eight_rows": (8, 2, torch.float32),
    "no_rows": (0, 3, torch.float32),
}


def full_state() -> dict[str, torch.Tensor]:
    """The full tensors (the same on every rank), random bits of each dtype."""
    g = torch.Generator().manual_seed(37)
    out = {}
    for name, (rows, cols, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(rows, cols, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-(1 << 40), 1 << 40, (rows, cols), generator=g, dtype=dtype)
    out["step"] = torch.tensor(12.0)  # replicated: kept once, on rank 0
    return out


def _sharded(mesh, full: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: v if k == "step" else distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def _check(target: dict, expected: dict[str, torch.Tensor]) -> None:
    for k, v in expected.items():
        got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got, v), k


def _empty_shards(plan) -> list[str]:
    """The keys of the empty shards of non-empty tensors in a final save plan."""
    return [
        it.index.fqn
        for it in plan.items
        if it.tensor_data is not None and 0 in it.tensor_data.chunk.sizes and 0 not in it.tensor_data.size
    ]


class _Recording(ReplicaGroupingSavePlanner):
    """The project's planner, keeping the final plan this rank writes."""

    def finish_plan(self, new_plan):
        self.final = super().finish_plan(new_plan)
        return self.final


def _save_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    expected = full_state()
    planner = _Recording()
    dcp.save(_sharded(mesh, expected), storage_writer=CheckpointWriter(Path(root) / "ckpt"), planner=planner)
    local = _sharded(mesh, expected)
    own = {k: tuple(v.to_local().shape) for k, v in local.items() if k != "step"}
    report = {"empty_in_final_plan": _empty_shards(planner.final), "local_shapes": own}
    if rank == 0:
        chunks = {
            k: [tuple(c.sizes) for c in m.chunks]
            for k, m in planner.metadata.state_dict_metadata.items()
            if k != "step"
        }
        report["metadata_chunks"] = chunks
    (Path(root) / f"save-{rank}.json").write_text(json.dumps(report))
    _load_and_check(mesh, Path(root), grid=False)


def _load_and_check(mesh, root: Path, grid: bool) -> None:
    expected = full_state()
    target = _sharded(mesh, {k: torch.zeros_like(v) for k, v in expected.items()})
    planner = GridLoadPlanner() if grid else None
    dcp.load(target, storage_reader=CheckpointReader(root / "ckpt"), planner=planner)
    _check(target, expected)


def _load_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _load_and_check(init_device_mesh("cpu", (world,)), Path(root), grid=True)
    dist.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("empty-shards")
    run_ranks(_save_worker, WORLD, str(root), report_dir=root / "reports-save", timeout=300)
    return root


@pytest.mark.slow
@pytest.mark.multiproc
def test_no_rank_writes_an_empty_shard_and_the_metadata_lists_none(saved: Path) -> None:
    reports = [json.loads((saved / f"save-{r}.json").read_text()) for r in range(WORLD)]
    # The state does give ranks empty shards (rank 3 of one_row, two_rows, three_rows, five_rows) ...
    assert [r["local_shapes"]["one_row"][0] for r in reports] == [1, 0, 0, 0]
    assert [r["local_shapes"]["five_rows"][0] for r in reports] == [2, 2, 1, 0]
    # ... and none of them reaches a rank's final plan or the Metadata.
    assert [r["empty_in_final_plan"] for r in reports] == [[]] * WORLD
    chunks = reports[0]["metadata_chunks"]
    assert chunks["one_row"] == [[1, 3]] and chunks["five_rows"] == [[2, 3], [2, 3], [1, 3]]
    assert chunks["eight_rows"] == [[2, 2]] * 4
    assert chunks["no_rows"] and all(0 in c for c in chunks["no_rows"])  # a tensor without elements keeps its record


@pytest.mark.slow
@pytest.mark.multiproc
def test_it_loads_bit_exact_at_4_3_and_1_ranks(saved: Path) -> None:
    # 4 ranks: in the save workers (a failure there fails the fixture). 3 ranks, GridLoadPlanner:
    run_ranks(_load_worker, 3, str(saved), report_dir=saved / "reports-load3", timeout=240)
    # 1 rank, no process group, plain tensors:
    expected = full_state()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(target, storage_reader=CheckpointReader(saved / "ckpt"), no_dist=True)
    _check(target, expected)
