"""Compact save plans (dcp/compact_plan.py, dcp/compact_global.py): the same decisions as the
planner's full path on torch's ``WriteItem`` lists, on mixed layouts, in one process.

Each layout is planned twice through the planner's methods as ``dcp.save`` calls them: with
compact plans, and with ``compact=False`` (the full path: rows widened and checked, empty shards
dropped, small replicas on the lowest rank, torch's dedup, global plan and validation). Every
rank's final items (without index hints, which the compact path leaves as the rank made them),
the ``Metadata`` (keys in order, sizes, properties, every chunk in order, the merged mappings)
and, for a layout the writer accepts, the commit record built from them must be equal.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from goodput_ckpt import CheckpointError
from goodput_ckpt.dcp.commit_build import build_manifest, forget_layouts
from goodput_ckpt.dcp.compact_global import LazyChunks
from goodput_ckpt.dcp.compact_plan import CompactFinal, CompactLocal
from goodput_ckpt.dcp.rank_reports import RankAssignment, rank_report
from goodput_ckpt.dcp.rank_rows import RankRow
from goodput_ckpt.dcp.save_planner import ReplicaGroupingSavePlanner
from goodput_ckpt.engine.layout import place_items
from goodput_ckpt.format.manifest import FileEntry


class Box:
    """A rank's shard of a distributed tensor, as DCP's planning sees a DTensor: one chunk."""

    def __init__(self, shape, offsets, sizes, dtype=torch.float32) -> None:
        self.shape, self.offsets, self.sizes, self.dtype = shape, offsets, sizes, dtype

    def __create_write_items__(self, fqn, obj):
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, TensorProperties(dtype=self.dtype), torch.Size(self.shape)),
            )
        ]


def fsdp(shape, rank, world):
    """FSDP2's ``Shard(0)`` box of ``rank`` (empty past the tensor's end, at offset dim 0)."""
    rows = -(-shape[0] // world)
    start = min(rank * rows, shape[0])
    n = max(0, min(rows, shape[0] - start))
    return Box(shape, (start, *[0] * (len(shape) - 1)), (n, *shape[1:]))


def fsdp_state(rank, world):
    """Model and AdamW state, nested, with tensors shorter than ``world`` rows (empty shards)."""
    shapes = {"a": (3, 4), "b": (13, 2), "c": (1, 5), "d": (40,)}
    return {
        "model": {k: fsdp(s, rank, world) for k, s in shapes.items()},
        "optim": {
            "state": {k: {"step": torch.tensor(7.0), "exp_avg": fsdp(s, rank, world)} for k, s in shapes.items()},
            "param_groups": [{"lr": 0.1, "params": list(shapes)}],
        },
    }


def mixed_state(rank, world):
    """Per-rank keys, small replicas held by some ranks only, 2-D sharding, rank rows."""
    tp = 2  # a 2-D grid: rows over world // tp, columns over tp
    r0, c0 = divmod(rank, tp)
    rows = 6 // (world // tp)
    sd = {
        "grid": Box((6, 6), (r0 * rows, c0 * 3), (rows, 3)),
        f"own.{rank}": torch.full((2,), float(rank)),
        "rng": RankRow(torch.full((1, 3), rank, dtype=torch.uint8), rank, world),
        "meta": {"epoch": 3},
        "step": torch.tensor(1.0),
    }
    if rank % 2:
        sd["odd"] = torch.ones(3)  # replicated on the odd ranks only: kept by rank 1
    if rank >= 2:
        sd["late"] = fsdp((5, 2), rank - 2, world - 2)  # a tensor the first ranks do not hold
    return sd


def widened_state(rank, world):
    row = torch.arange(rank + 1, dtype=torch.uint8)[None]  # each rank's blob a different length
    sd = {"w": fsdp((9, 2), rank, world), "loader": RankRow(row, rank, world, widen=True)}
    return sd


def plan(states, *, compact, widen=(), flatten=True):
    """The plan exchange of ``len(states)`` ranks: each rank's final plan and the Metadata."""
    world = len(states)
    planners = [
        ReplicaGroupingSavePlanner(compact=compact, widen_rows=widen, flatten_state_dict=flatten) for _ in states
    ]
    for r, (p, sd) in enumerate(zip(planners, states)):
        p.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=r == 0)
    sent = [pickle.loads(pickle.dumps(p.create_local_plan())) for p in planners]  # as gather_object
    scatter, md = planners[0].create_global_plan(sent)
    scatter = [
        pickle.loads(pickle.dumps(dataclasses.replace(s, storage_data=RankAssignment(r, "t"))))
        for r, s in enumerate(scatter)
    ]
    final = [p.finish_plan(s) for p, s in zip(planners, scatter)]
    assert len(final) == world
    return sent, scatter, final, md


def _plain(item):
    return dataclasses.replace(item, index=dataclasses.replace(item.index, index=None))


def _md(md):
    out = []
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "chunks"):
            out.append((k, tuple(v.size), v.properties, [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks]))
        else:
            out.append((k, type(v).__name__))
    return out, md.planner_data


def _manifest(md, final):
    """The commit record of these final plans, with the writer's own report of each rank."""
    forget_layouts()
    results = []
    for r, p in enumerate(final):
        items = sorted(p.items, key=lambda it: it.type == WriteItemType.SHARD)
        own = sum(1 for it in items if it.type != WriteItemType.SHARD)
        sizes = [16 if it.tensor_data is None else 4 for it in items]
        placements, file_sizes = place_items(sizes, 1)
        files = [FileEntry(f"r{r}-{f}.bin", s, ("0" * 64,)) for f, s in enumerate(file_sizes)]
        where = {q.item: (q.file, q.offset, q.length) for q in placements}
        written = tuple(
            (it.index.fqn, None if it.index.offset is None else tuple(it.index.offset), *where[i])
            for i, it in enumerate(items)
        )
        results.append(rank_report(files, written, items, own=own, assignment=RankAssignment(r, "t")))
    return build_manifest(md, results, chunk_size=1 << 20, created_at="x", user_metadata={}).to_json()


def assert_same(states, compact_step=True, **kw):
    sent_c, scatter, final_c, md_c = plan(states, compact=True, **kw)
    assert all(isinstance(s.planner_data, CompactFinal) for s in scatter) == compact_step
    _, _, final_f, md_f = plan(states, compact=False, **kw)
    for r in range(len(states)):
        assert [_plain(i) for i in final_c[r].items] == [_plain(i) for i in final_f[r].items], r
        assert final_c[r].planner_data == final_f[r].planner_data
    assert _md(md_c) == _md(md_f)
    return sent_c, md_c, final_c, final_f, md_f


@pytest.mark.parametrize("world", [1, 2, 5, 8])
def test_fsdp_layouts_plan_as_the_full_path_with_no_write_item_sent(world):
    states = [fsdp_state(r, world) for r in range(world)]
    sent, md, final_c, final_f, md_f = assert_same(states)
    for p in sent:  # what the gather pickles: no WriteItem, no torch object but the properties
        assert not p.items and isinstance(p.planner_data, CompactLocal)
        assert b"WriteItem" not in pickle.dumps(p)
    assert all(isinstance(v.chunks, LazyChunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    assert _manifest(md, final_c) == _manifest(md_f, final_f)  # the commit record, byte for byte


def test_mixed_layouts_plan_as_the_full_path():
    world = 6
    states = [mixed_state(r, world) for r in range(world)]
    sent, md, final_c, final_f, md_f = assert_same(states)
    keepers = {r: {i.index.fqn for i in p.items if i.type != WriteItemType.SHARD} for r, p in enumerate(final_c)}
    assert "step" in keepers[0] and "meta.epoch" in keepers[0] and "odd" in keepers[1]
    assert all("step" not in keepers[r] for r in range(1, world))
    assert _manifest(md, final_c) == _manifest(md_f, final_f)


def test_widened_rows_plan_as_the_full_path():
    world = 4
    states = [widened_state(r, world) for r in range(world)]
    states[3].pop("loader")  # a rank without a row writes zeros
    _, md, final_c, *_ = assert_same(states, widen=("loader",))
    assert tuple(md.state_dict_metadata["loader"].size) == (world, 3)
    assert [i.tensor_data.size for i in final_c[3].items if i.index.fqn == "loader"] == [torch.Size((world, 3))]


def test_unflattened_plans_plan_as_the_full_path():
    world = 3
    states = [{"x": fsdp((7, 2), r, world), "s": torch.tensor(1.0)} for r in range(world)]
    assert_same(states, flatten=False)


def test_a_large_replica_takes_the_full_path_with_torchs_balancing():
    world = 3
    states = [
        {"w": fsdp((6, 2), r, world), "big": torch.zeros(1 << 19), "big2": torch.ones(1 << 19)} for r in range(world)
    ]
    _, scatter, final, _ = plan(states, compact=True)
    assert not any(isinstance(s.planner_data, CompactFinal) for s in scatter)  # planned in full
    owners = [next(r for r, p in enumerate(final) if any(i.index.fqn == k for i in p.items)) for k in ("big", "big2")]
    assert owners[0] != owners[1]  # balanced by bytes, as torch's dedup does
    assert_same(states, compact_step=False)


def test_duplicated_shards_take_the_full_path():
    world = 4  # HSDP: two replicas of a 2-way shard
    states = [{"w": fsdp((6, 2), r % 2, 2)} for r in range(world)]
    _, scatter, _, _ = plan(states, compact=True)
    assert not any(isinstance(s.planner_data, CompactFinal) for s in scatter)
    assert_same(states, compact_step=False)


def test_overlapping_chunks_are_refused_as_torch_refuses_them():
    states = [{"w": Box((4, 2), (0, 0), (3, 2))}, {"w": Box((4, 2), (1, 0), (3, 2))}]  # overlap, volume 12 != 8
    for compact in (True, False):
        with pytest.raises(ValueError, match="Failed to validate global plan"):
            plan(states, compact=compact)
    # Overlapping, with a gap: the volumes add up, so only the overlap check can tell.
    states = [
        {"w": Box((4, 2), (0, 0), (2, 2))},
        {"w": Box((4, 2), (1, 0), (2, 2))},
        {"w": Box((4, 2), (4, 0), (0, 2))},
    ]
    for compact in (True, False):
        with pytest.raises(ValueError, match="overlapping"):
            plan(states, compact=compact)


def test_ranks_that_disagree_on_a_rows_shape_are_refused_by_the_full_paths_check():
    world = 2
    states = [{"rng": RankRow(torch.zeros((1, 2 + r), dtype=torch.uint8), r, world)} for r in range(world)]
    with pytest.raises(CheckpointError, match="disagree on the shape"):
        plan(states, compact=True)


def test_lazy_chunks_pickle_as_a_list():
    world = 3
    _, _, _, md = plan([fsdp_state(r, world) for r in range(world)], compact=True)
    chunks = md.state_dict_metadata["model.b"].chunks
    assert len(chunks) == 3 and type(pickle.loads(pickle.dumps(chunks))) is list


def test_a_rank_that_sends_its_plan_in_full_has_every_plan_planned_in_full():
    world = 3
    states = [fsdp_state(r, world) for r in range(world)]
    planners = [ReplicaGroupingSavePlanner(compact=r != 1) for r in range(world)]
    for r, (p, sd) in enumerate(zip(planners, states)):
        p.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=r == 0)
    sent = [p.create_local_plan() for p in planners]
    scatter, _ = planners[0].create_global_plan(sent)
    final = [p.finish_plan(s) for p, s in zip(planners, scatter)]
    _, _, expected, _ = plan(states, compact=False)
    assert [[_plain(i) for i in f.items] for f in final] == [[_plain(i) for i in f.items] for f in expected]


def test_the_writer_refuses_compact_plans_a_foreign_coordinator_passed_on(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from goodput_ckpt import CheckpointWriter

    ours = ReplicaGroupingSavePlanner()
    ours.set_up_planner(state_dict=fsdp_state(0, 1), storage_meta=None, is_coordinator=True)
    # (with flattening on, torch's own global step already fails on them, merging their mappings)
    plans, _ = DefaultSavePlanner(flatten_state_dict=False).create_global_plan([ours.create_local_plan()])
    writer = CheckpointWriter(tmp_path / "c")
    writer.set_up_storage_writer(True)
    with pytest.raises(CheckpointError, match="compact"):
        writer.prepare_global_plan(plans)
