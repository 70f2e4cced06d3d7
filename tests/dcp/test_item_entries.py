"""The coordinator's item entries from every rank's compact RankWrites (dcp/item_entries.py):
for uneven last shards, FSDP x TP grids, tensors saved by some ranks only, ranks without a
shard, objects and irregular shardings, the v2 entries (grids where the chunks are one) hold
exactly the chunks each rank wrote, where it wrote them, and irregular layouts fall back to
explicit chunks. Real multi-rank saves of the same path are in test_scale.py and
test_commit_reuse.py; the simulated saves are helpers.dcp_saves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.dcp_saves import fsdp, save, split
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata

from goodput_ckpt.dcp.commit_build import build_manifest, forget_layouts
from goodput_ckpt.dcp.item_entries import _Rows
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.format.grid import GridChunks
from goodput_ckpt.format.manifest import ChunkEntry, parse_manifest


def build(md, results, version=2):
    forget_layouts()
    return build_manifest(md, results, chunk_size=1 << 20, created_at="", user_metadata={}, version=version)


def check(world, tensors, objects=None, plain=()):
    """Both formats hold every chunk where its rank wrote it; the v2 record parses. Returns the
    v2 items."""
    md, results, where = save(world, tensors, objects, plain)
    for version in (1, 2):
        m = build(md, results, version)
        for key, e in m.items.items():
            if e.kind == "object":
                r, off, n = where[key]
                assert (e.file, e.offset, e.length) == (f"rank{r}.bin", off, n)
                continue
            got = sorted(e.chunks, key=lambda c: c.offsets)
            want = sorted(
                (
                    ChunkEntry(o, s, f"rank{where[key, o][0]}.bin", where[key, o][1], where[key, o][2])
                    for o, s, _ in tensors[key][1]
                ),
                key=lambda c: c.offsets,
            )
            assert [c for c in got if c.length] == [c for c in want if c.length], key
        parse_manifest(m.to_json())  # every check a reader makes, spans and tiling included
    return m.items


def test_fsdp_uneven_last_shards_are_grids():
    tensors = {f"t{i}": ((10 + i, 3), fsdp((10 + i, 3), 4)) for i in range(6)}
    items = check(4, tensors)
    assert all(isinstance(e.chunks, GridChunks) for e in items.values())
    assert any(len(e.chunks.runs) > 1 for e in items.values())  # the short last rank shifted offsets


def test_fsdp_x_tp_two_dimensional_grid():
    dp, tp = 3, 4
    boxes = [
        ((o0, o1), (n0, n1), i * tp + j)
        for i, (o0, n0) in enumerate(split(9, dp))
        for j, (o1, n1) in enumerate(split(10, tp))
    ]
    items = check(dp * tp, {"w": ((9, 10), boxes), "b": ((12,), fsdp((12,), 12))})
    assert isinstance(items["w"].chunks, GridChunks) and items["w"].chunks.block == (3, 3)


def test_a_tensor_saved_by_some_ranks_only_and_ranks_without_shards():
    # a norm saved by the first TP rank of each of 2 FSDP groups (ranks 0 and 4); a 2-row tensor
    # on 8 ranks: ranks 2-7 hold no shard of it; rank 7 holds nothing at all
    norm = [((0,), (4,), 0), ((4,), (4,), 4)]
    items = check(8, {"norm": ((8,), norm), "small": ((2, 5), fsdp((2, 5), 2)), "w": ((14, 2), fsdp((14, 2), 7))})
    assert all(isinstance(e.chunks, GridChunks) for e in items.values())
    assert items["norm"].chunks.runs == ((2, 0, 4, 0),)  # cell k in file 4 k


def test_empty_chunks_of_ranks_past_the_end_are_left_out():
    boxes = fsdp((3, 2), 3) + [((3, 0), (0, 2), 3)]  # torch's empty chunk on rank 3
    items = check(4, {"w": ((3, 2), boxes)})
    assert isinstance(items["w"].chunks, GridChunks) and len(items["w"].chunks) == 3


def test_irregular_shardings_fall_back_to_explicit_chunks():
    # strided TP-then-FSDP blocks of uneven sizes, and a column split at different rows
    strided = [((0,), (3,), 0), ((3,), (2,), 1), ((5,), (3,), 2), ((8,), (2,), 3)]
    stair = [((0, 0), (3, 1), 0), ((3, 0), (5, 1), 1), ((0, 1), (5, 1), 2), ((5, 1), (3, 1), 3)]
    items = check(4, {"s": ((10,), strided), "st": ((8, 2), stair), "g": ((8,), fsdp((8,), 4))})
    assert not isinstance(items["s"].chunks, GridChunks)
    assert not isinstance(items["st"].chunks, GridChunks)
    assert isinstance(items["g"].chunks, GridChunks)


def test_objects_and_mixed_key_lists():
    # rank 0 also holds objects: its own items differ from the others', its shards do not
    tensors = {"a": ((8, 3), fsdp((8, 3), 4)), "b": ((5,), fsdp((5,), 4))}
    items = check(4, tensors, {"step": [0], "rng.rank2": [2], "shared": [1, 3]})
    assert items["shared"].file == "rank3.bin"
    assert list(items) == ["step", "rng.rank2", "shared", "a", "b"]  # DCP's order


def test_a_chunk_no_rank_wrote_is_an_error():
    md, results, _ = save(2, {"w": ((4,), fsdp((4,), 2))})
    md.state_dict_metadata["w"].chunks.append(ChunkStorageMetadata(offsets=torch.Size((4,)), sizes=torch.Size((1,))))
    with pytest.raises(CheckpointError, match="no rank wrote"):
        build(md, results)
    md, results, _ = save(2, {"w": ((4,), fsdp((4,), 2))}, {"x": [0]})
    md.state_dict_metadata["y"] = BytesStorageMetadata()
    with pytest.raises(CheckpointError, match="no rank wrote"):
        build(md, results)


def test_ranks_whose_tables_have_other_widths():
    # ranks 0-1 hold a 2-D and a 1-D tensor (tables with 2 offset columns), ranks 2-3 only the
    # 1-D one (1 column): the 1-D tensor's rows come from both groups, padded to one width
    items = check(4, {"w": ((2, 3), fsdp((2, 3), 4)), "b": ((12,), fsdp((12,), 4))})
    assert isinstance(items["b"].chunks, GridChunks) and isinstance(items["w"].chunks, GridChunks)


def test_per_rank_items_do_not_split_the_ranks_groups():
    """What CheckpointManager saves besides the model: each rank's generators under a key naming
    the rank (plain tensors and objects), scalars only rank 0 keeps (AdamW's steps). The ranks'
    shards still form one group, so the sharded tensors take the batched path; each rank's own
    items are a group of one. (Were the own keys in the group digest, every rank would be a
    group of its own, and each tensor's rows gathered from W groups in Python.)"""
    world = 8
    tensors = {f"w{i}": ((8 * (2 + i), 3), fsdp((8 * (2 + i), 3), world)) for i in range(5)}
    plain = {f"rng.rank{r}.torch": ((6,), [((0,), (6,), r)]) for r in range(world)}
    plain |= {f"step{i}": ((1,), [((0,), (1,), 0)]) for i in range(3)}
    objects = {f"loader.rank{r}": [r] for r in range(world)}
    items = check(world, tensors | plain, objects, plain=set(plain))
    assert all(isinstance(items[k].chunks, GridChunks) and len(items[k].chunks) == world for k in tensors)
    assert items["rng.rank5.torch"].chunks[0].file == "rank5.bin"
    md, results, _ = save(world, tensors | plain, objects, plain=set(plain))
    rows = _Rows(md, [r[0].storage_data for r in results])
    assert [len(g.tables) for g in rows.groups] == [world] + [1] * world
    assert [rw[0].storage_data.own for rw in results] == [3 + 1 + 1] + [2] * (world - 1)


def test_own_items_out_of_range_are_an_error():
    md, results, _ = save(2, {"w": ((4,), fsdp((4,), 2))})
    rw = results[1][0].storage_data
    results[1][0] = dataclasses.replace(results[1][0], storage_data=dataclasses.replace(rw, own=len(rw.table) + 1))
    with pytest.raises(CheckpointError, match="own items"):
        build(md, results)
