"""The simulated inputs of ``bench_scale_save.py``: each rank's FSDP2 + AdamW state dict of
stand-in DTensor shards (torch's own write items, empty shards included), and what each writer's
``write_data`` returns for a plan without hashing or writing data (the module doc of
``bench_scale_save.py`` says why they equal the real path).
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

sys.path.insert(0, os.path.dirname(__file__))
from bench_scale import PARAM_GROUP_KEYS, model_tensors  # noqa: E402

from goodput_ckpt import CheckpointWriter  # noqa: E402
from goodput_ckpt.dcp.plan_cache import SavePlanCache  # noqa: E402
from goodput_ckpt.dcp.rank_reports import rank_report  # noqa: E402
from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner  # noqa: E402
from goodput_ckpt.engine.hashed_write import data_file_name  # noqa: E402
from goodput_ckpt.engine.layout import place_items  # noqa: E402
from goodput_ckpt.format.manifest import DTYPE_SIZES, FileEntry  # noqa: E402

CHUNK = 8 << 20


def timed_ranks(world: int) -> dict[int, str]:
    return {0: "coordinator", 1: "rank 1", world // 2: f"rank {world // 2}"}


_BOXES: dict[tuple[tuple[int, ...], int, int], Any] = {}


class SimShard:
    """One rank's shard of a DTensor ``Shard(0)`` over ``world`` ranks, as DCP's planning sees it."""

    __slots__ = ("shape", "dtype", "rank", "world")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int) -> None:
        self.shape, self.dtype, self.rank, self.world = shape, dtype, rank, world

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        key = (self.shape, self.rank, self.world)
        if self.rank in timed_ranks(self.world) or key not in _BOXES:  # a timed rank pays it every save
            _BOXES[key] = _compute_local_shape_and_global_offset(self.shape, (self.world,), [self.rank], [Shard(0)])
        sizes, offsets = _BOXES[key]  # an untimed rank: computed once per run (the benchmark's own time)
        sizes, offsets = torch.Size(sizes), torch.Size(offsets)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=self.dtype),
                    size=torch.Size(self.shape),
                ),
            )
        ]


def state_dict(layout: str, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s FSDP2 + AdamW state dict, nested as ``get_state_dict`` returns it."""
    tensors = model_tensors(layout)
    params = [t for t in tensors if t.dtype == "bfloat16"]
    model = {t.fqn: SimShard(t.shape, torch.bfloat16, rank, world) for t in params}
    state = {
        p.fqn: {
            "step": torch.tensor(100.0),
            "exp_avg": SimShard(p.shape, torch.float32, rank, world),
            "exp_avg_sq": SimShard(p.shape, torch.float32, rank, world),
        }
        for p in params
    }
    groups = [
        {
            k: (0.9, 0.95) if k == "betas" else ([p.fqn for p in params] if k == "params" else 1e-4)
            for k in PARAM_GROUP_KEYS
        }
    ]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


# -- one rank's steps of dcp.save (bench_scale_save.py's module doc, steps 1 and 3) ----------------
def plan_cache(method: str) -> SavePlanCache | None:
    """A rank's plan cache, kept from one save to the next (``ours`` and ``ours-full`` only)."""
    return SavePlanCache() if method in ("ours", "ours-full") else None


def planner(method: str, cache: SavePlanCache | None) -> Any:
    if method.startswith("ours"):
        return ReplicaGroupingSavePlanner(plan_cache=cache, compact=method != "ours-full")
    return DefaultSavePlanner()


def writer(method: str, root: str, save: int) -> Any:
    path = os.path.join(root, f"{method}-{save}")
    if method.startswith("ours"):
        return CheckpointWriter(path, overwrite=True)
    return FileSystemWriter(path, overwrite=False)  # a fresh directory per save and repeat


def local_step(planner: Any, writer: Any, state: dict[str, Any], rank: int) -> bytes:
    """Step 1 on ``rank``: its local plan, pickled as ``gather_object`` pickles it."""
    meta = writer.storage_meta()
    planner.set_up_planner(state_dict=state, storage_meta=meta, is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return pickle.dumps(writer.prepare_local_plan(planner.create_local_plan()))


def write_step(planner: Any, method: str, scattered: bytes) -> bytes:
    """Step 3 on a rank: its final plan unpickled, ``finish_plan``, write_data's bookkeeping, its
    results pickled (the ``all_reduce`` gather)."""
    plan = planner.finish_plan(pickle.loads(scattered))
    return pickle.dumps(ours_results(plan) if method.startswith("ours") else torch_results(plan))


# -- write_data's bookkeeping ------------------------------------------------------------------------
def ours_results(plan: SavePlan) -> list[WriteResult]:
    """What ``CheckpointWriter._write_rank`` returns for ``plan``, without hashing or writing: its
    items ordered and placed, then its report (its rows left out when the coordinator announced
    this rank's layout in ``plan.storage_data``) from ``rank_report``, the writer's own function."""
    assignment = plan.storage_data
    items = sorted(plan.items, key=lambda it: it.type == WriteItemType.SHARD)
    own = sum(1 for it in items if it.type != WriteItemType.SHARD)
    placements, file_sizes = place_items([_nbytes(it) for it in items], 1)
    names = [data_file_name(assignment.rank_index, f, assignment.token) for f in range(len(file_sizes))]
    entries = [
        FileEntry(n, s, tuple(f"{i:064x}" for i in range(math.ceil(s / CHUNK)))) for n, s in zip(names, file_sizes)
    ]
    where = {p.item: (p.file, p.offset, p.length) for p in placements}
    written = tuple(
        (it.index.fqn, None if it.index.offset is None else tuple(it.index.offset), *where[i])
        for i, it in enumerate(items)
    )
    return rank_report(entries, written, items, own=own, assignment=assignment)


def torch_results(plan: SavePlan) -> list[WriteResult]:
    """What ``FileSystemWriter.write_data`` returns for ``plan`` (one file per rank)."""
    name, off, out = f"{plan.storage_data.prefix}0.distcp", 0, []  # one string per file, as torch's (pickled once)
    for it in plan.items:
        n = _nbytes(it)
        out.append(WriteResult(index=it.index, size_in_bytes=n, storage_data=_StorageInfo(name, off, n)))
        off += n
    return out


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 100
    return (
        math.prod(item.tensor_data.chunk.sizes)
        * DTYPE_SIZES[str(item.tensor_data.properties.dtype).removeprefix("torch.")]
    )
