"""The bytes a first save's compact plans cost (dcp/compact_plan.py, dcp/plan_cache.py), counted,
not timed (issue 37): box rows only for shards, the box table compressed, the coordinator's plan
cache holding one copy of each schema and mappings, and every decompression of a peer's blob
bounded, its refusal naming the rank.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from goodput_ckpt import CheckpointError
from goodput_ckpt.dcp.compact_plan import MAX_BLOB, CompactLocal, inflate
from goodput_ckpt.dcp.plan_cache import SavePlanCache
from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner


class Shard:
    """A rank's ``Shard(0)`` piece of a distributed tensor, as DCP's planning sees a DTensor."""

    def __init__(self, rows: int, cols: int, rank: int, world: int) -> None:
        self.rows, self.cols, self.rank, self.world = rows, cols, rank, world

    def __create_write_items__(self, fqn, obj):
        n = self.rows // self.world
        chunk = ChunkStorageMetadata(torch.Size((self.rank * n, 0)), torch.Size((n, self.cols)))
        data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size((self.rows, self.cols)))
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]


def state(rank: int, world: int, tensors: int = 40, scalars: int = 40) -> dict:
    """Model and AdamW-like state: ``tensors`` shards and ``scalars`` replicated ``step`` values."""
    return {
        "model": {f"w{i}": Shard(8 * world, 4, rank, world) for i in range(tensors)},
        "optim": {f"s{i}": {"step": torch.tensor(3.0)} for i in range(scalars)},
    }


def local_plans(states, caches=None):
    """Each rank's local plan as the coordinator unpickles it, and the planners."""
    planners = [
        ReplicaGroupingSavePlanner(plan_cache=None if caches is None else caches[r]) for r in range(len(states))
    ]
    for r, (p, sd) in enumerate(zip(planners, states)):
        p.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=r == 0)
    return [pickle.loads(pickle.dumps(p.create_local_plan())) for p in planners], planners


def test_replicated_scalars_add_no_box_rows() -> None:
    few = local_plans([state(r, 4, scalars=2) for r in range(4)])[0]
    many = local_plans([state(r, 4, scalars=700) for r in range(4)])[0]
    # 698 more 0-d tensors: the schema grows (their keys), the boxes not by a byte
    assert [len(p.planner_data.boxes) for p in many] == [len(p.planner_data.boxes) for p in few]


def test_the_box_table_is_compressed() -> None:
    plan = local_plans([state(r, 4, tensors=400) for r in range(4)])[0][1].planner_data
    raw = 400 * 2 * plan.dims * 8  # the int64 table as it was sent before
    assert len(plan.boxes) * 4 < raw
    assert plan.box_table(400).shape == (400, 4)


def test_the_coordinators_cache_keeps_one_schema_and_one_mappings_for_ranks_that_sent_the_same() -> None:
    world = 8
    caches = [SavePlanCache() for _ in range(world)]
    sent, planners = local_plans([state(r, world) for r in range(world)], caches)
    scatter, _ = planners[0].create_global_plan(sent)
    for p, s in zip(planners, scatter):
        p.finish_plan(dataclasses.replace(s, storage_data=None))
    held = [p.planner_data for p in caches[0]._global[1]]
    assert all(isinstance(d, CompactLocal) for d in held)
    # unpickled apart (as gathered), the blobs are kept once each: one schema and one mappings object
    assert len({id(d.schema) for d in held}) == 1 and len({id(d.mappings) for d in held}) == 1
    per_rank = sum(len(d.boxes) for d in held) + len(held[0].schema) + len(held[0].mappings)
    assert per_rank < sum(len(d.schema) + len(d.mappings) + len(d.boxes) for d in held) / 4


def _bomb(size: int) -> bytes:
    return zlib.compress(b"\0" * size, 9)


def test_inflate_bounds_what_it_decompresses_and_names_the_blob() -> None:
    assert inflate(_bomb(100), 100, "x", exact=True) == b"\0" * 100
    with pytest.raises(CheckpointError, match="rank 3's boxes is torn or decompresses past 99 bytes"):
        inflate(_bomb(100), 99, "rank 3's boxes")
    with pytest.raises(CheckpointError, match="decompresses to 100 bytes, not 101"):
        inflate(_bomb(100), 101, "y", exact=True)
    with pytest.raises(CheckpointError, match="past 0 bytes"):  # zlib's max_length=0 would not bound it
        inflate(_bomb(1 << 20), 0, "an empty table", exact=True)
    assert inflate(zlib.compress(b""), 0, "empty", exact=True) == b""
    with pytest.raises(CheckpointError, match="does not decompress"):
        inflate(b"not zlib", 10, "z")
    with pytest.raises(CheckpointError, match="torn"):
        inflate(_bomb(100)[:-6], 100, "z")  # cut short: no end of stream


@pytest.mark.parametrize("field", ["schema", "mappings", "boxes"])
def test_a_peer_blob_that_decompresses_past_its_bound_fails_the_global_step_naming_the_rank(field) -> None:
    world = 4
    sent, planners = local_plans([state(r, world) for r in range(world)])
    data = sent[2].planner_data
    forged = {"schema": _bomb(MAX_BLOB + 1), "mappings": _bomb(MAX_BLOB + 1), "boxes": _bomb(len(data.boxes) * 100)}
    digests = {"schema": {"schema_digest": b"x" * 16}, "mappings": {"mappings_digest": b"y" * 16}, "boxes": {}}
    sent[2] = dataclasses.replace(
        sent[2], planner_data=dataclasses.replace(data, **{field: forged[field]}, **digests[field])
    )
    with pytest.raises(CheckpointError, match="rank 2's compact save plan's .*(torn|past)"):
        planners[0].create_global_plan(sent)
