"""batched_grids (engine/group_grids.py), the coordinator's grid detection over whole groups of
ranks, against its oracle, the per-tensor path it stands in front of (the tensor's rows gathered
and given to grid_from_rows, what every tensor went through before): on regular FSDP, FSDP x TP
and partly held layouts, and on the same layouts with random rows altered (offsets, sizes,
lengths, files, dimension counts, padding), the batched path decides a tensor only where the
oracle finds a grid, with the same runs, and the whole record is the same as with the batched
path switched off."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.dcp_saves import fsdp, save, split
from helpers.seeds import for_each_seed

from goodput_ckpt.dcp import item_entries
from goodput_ckpt.dcp.commit_build import build_manifest, forget_layouts
from goodput_ckpt.dcp.item_entries import _chunks, _Rows, _spec
from goodput_ckpt.engine import group_grids
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.format.grid import GridChunks


def layout(rng: np.random.Generator, world: int) -> dict:
    """Random tensors: FSDP over all or some ranks (uneven last shards, ranks without one),
    FSDP x TP, a norm saved by a few ranks, shapes with one to three dimensions."""
    tensors: dict = {}
    for i in range(int(rng.integers(3, 9))):
        dims = int(rng.integers(1, 4))
        shape = (int(rng.integers(1, 3 * world)),) + tuple(int(x) for x in rng.integers(1, 5, dims - 1))
        kind = rng.integers(0, 4)
        if kind == 0 and dims >= 2 and world % 2 == 0:
            dp, tp = world // 2, 2
            boxes = [
                ((o0, o1) + (0,) * (dims - 2), (n0, n1) + shape[2:], a * tp + b)
                for a, (o0, n0) in enumerate(split(shape[0], dp))
                for b, (o1, n1) in enumerate(split(shape[1], tp))
            ]
        elif kind == 1:
            held = int(rng.integers(1, world + 1))
            boxes = fsdp(shape, held)
        elif kind == 2:
            step = int(rng.integers(1, 3))
            ranks = list(range(0, world, step))
            boxes = [(o, s, ranks[k]) for k, (o, s, _) in enumerate(fsdp(shape, len(ranks)))]
        else:
            boxes = fsdp(shape, world)
        tensors[f"t{i}"] = (shape, boxes)
    return tensors


def owned(rng: np.random.Generator, world: int) -> dict:
    """Tensors a rank writes whole and alone (a training job's per-rank generator state under
    a key naming the rank, a replicated scalar the lowest rank keeps): its own items."""
    out: dict = {}
    for r in range(world):
        for j in range(int(rng.integers(0, 3))):
            shape = tuple(int(x) for x in rng.integers(1, 6, int(rng.integers(1, 4))))
            out[f"own.rank{r}.{j}"] = (shape, [((0,) * len(shape), shape, r)])
    return out


def alter(rng: np.random.Generator, results: list, count: int) -> None:
    """Change ``count`` random cells of the ranks' tables in place (a hostile or buggy rank)."""
    tables = [r[0].storage_data.table for r in results if len(r[0].storage_data.table)]
    for _ in range(count):
        table = tables[int(rng.integers(len(tables)))]
        row, col = int(rng.integers(table.shape[0])), int(rng.integers(table.shape[1]))
        table[row, col] += int(rng.choice([-4096, -1, 1, 2, 4096]))


def oracle(md, ranks, names):
    """Per tensor: the grid the per-tensor path finds, or None."""
    rows = _Rows(md, ranks)
    out = []
    for t, (fqn, m) in enumerate(md.state_dict_metadata.items()):
        cols, owners = rows.of(t)
        if _spec(m) is None:
            out.append(None)
            continue
        try:
            got = _chunks(fqn, m, cols, owners, names, grids=True)
        except CheckpointError:  # a chunk no rank wrote: not a grid either
            got = None
        out.append(got if isinstance(got, GridChunks) else None)
    return rows, out


def compare(md, results, decided_keys: list | None = None) -> tuple[int, int]:
    """Batched against the oracle on every tensor; (tensors the batched path decided, grids).
    The keys of the tensors it decided are appended to ``decided_keys``."""
    ranks = [r[0].storage_data for r in results]
    names = tuple(f.path for rw in ranks for f in rw.files)
    rows, want = oracle(md, ranks, names)
    specs = [_spec(m) for m in md.state_dict_metadata.values()]
    got = group_grids.batched_grids(rows.groups, rows.where, specs, names)
    decided = 0
    for t, (g, w) in enumerate(zip(got, want)):
        if g is not None:
            decided += 1
            if decided_keys is not None:
                decided_keys.append(list(md.state_dict_metadata)[t])
            assert w is not None, f"tensor {t}: batched found a grid the oracle does not"
            assert (g.block, g.runs, g.shape, g.esize) == (w.block, w.runs, w.shape, w.esize), t
    return decided, sum(w is not None for w in want)


def record(md, results, monkeypatch, batched: bool) -> bytes:
    with monkeypatch.context() as m:
        if not batched:
            m.setattr(item_entries, "batched_grids", lambda groups, where, specs, names: [None] * len(specs))
        forget_layouts()
        return build_manifest(md, results, chunk_size=1 << 20, created_at="", user_metadata={}, version=2).to_json()


def same_record(md, results, monkeypatch) -> None:
    """The record with the batched path is the one without it, or both builds refuse alike."""
    try:
        want = record(md, results, monkeypatch, False)
    except Exception as e:  # an altered row may name a chunk no rank wrote
        with pytest.raises(type(e)):
            record(md, results, monkeypatch, True)
        return
    assert record(md, results, monkeypatch, True) == want


def test_regular_layouts_are_decided_in_batch_as_the_oracle_decides(monkeypatch):
    for_each_seed(range(40), lambda seed: _regular_layouts_decided_in_batch(seed, monkeypatch))


def _regular_layouts_decided_in_batch(seed: int, monkeypatch) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 13))
    own = owned(rng, world)
    tensors = layout(rng, world)
    md, results, _ = save(world, tensors | own, plain=set(own))
    keys: list = []
    decided, grids = compare(md, results, keys)
    # Every tensor a rank wrote whole (one cell) is decided here. (Sharded ones only where their
    # rows come in cell order: ranks whose key lists differ can form groups that are not runs
    # of ranks, whose rows are left to the oracle; test_per_rank_objects_... has one group.)
    assert grids and decided >= 1
    assert set(own) <= set(keys), sorted(set(own) - set(keys))
    same_record(md, results, monkeypatch)


def test_altered_rows_never_make_the_batched_path_disagree(monkeypatch):
    for_each_seed(range(200), lambda seed: _altered_rows_agree(seed, monkeypatch))


def _altered_rows_agree(seed: int, monkeypatch) -> None:
    rng = np.random.default_rng(1000 + seed)
    world = int(rng.integers(2, 13))
    own = owned(rng, world)
    md, results, _ = save(world, layout(rng, world) | own, plain=set(own))
    alter(rng, results, int(rng.integers(1, 4)))
    compare(md, results)
    same_record(md, results, monkeypatch)


def test_many_members_span_several_blocks(monkeypatch):
    # 3,000 ranks x 40 tensors: a block holds fewer members than a group, so pairs straddle
    # blocks; a tensor held by the first 1,000 ranks only makes a second group
    monkeypatch.setattr(group_grids, "_BLOCK_ELEMENTS", 1 << 12)
    world = 3000
    tensors = {f"w{i}": ((world * 2 + 7 * i, 3), fsdp((world * 2 + 7 * i, 3), world)) for i in range(40)}
    tensors["part"] = ((1000,), fsdp((1000,), 1000))
    md, results, _ = save(world, tensors)
    decided, grids = compare(md, results)
    assert decided == grids == len(tensors)
    rng = np.random.default_rng(7)
    alter(rng, results, 5)
    compare(md, results)


def test_a_tensor_with_more_irregular_pairs_than_the_cap_is_left_to_the_oracle():
    world = 64
    md, results, _ = save(world, {"w": ((world,), fsdp((world,), world))})
    for r in range(0, world, 2):  # every other rank's offset shifted: 32 runs of one cell
        results[r][0].storage_data.table[0, 1] += 4096
    ranks = [r[0].storage_data for r in results]
    names = tuple(f.path for rw in ranks for f in rw.files)
    rows = _Rows(md, ranks)
    got = group_grids.batched_grids(rows.groups, rows.where, [_spec(m) for m in md.state_dict_metadata.values()], names)
    assert got == [None] and group_grids._irregular_cap(world) < world - 1
    assert compare(md, results) == (0, 1)


def test_a_full_block_claimed_for_the_short_last_cell_is_refused(monkeypatch):
    # shape (10, 3) over 4 ranks: blocks of 3, 3, 3 and 1 rows. Rank 3 claims 3 rows (and their
    # bytes) at offset 9: its row differs from rank 2's exactly as a regular grid's would, so
    # only checking the last row against its cell catches it
    md, results, _ = save(4, {"w": ((10, 3), fsdp((10, 3), 4))})
    table = results[3][0].storage_data.table
    table[0, 2], table[0, 6] = 3 * 3 * 4, 3  # length, size along dimension 0
    assert compare(md, results) == (0, 0)
    same_record(md, results, monkeypatch)


def test_one_group_per_rank_takes_the_per_tensor_path(monkeypatch):
    # every rank also holds the one shard of a tensor no other rank holds: its shards' keys
    # differ from every other rank's, so each rank is a group of one, a tensor's 200 rows lie
    # in 200 parts, and the batched path, which would look at every boundary in Python, leaves
    # the tensors to the oracle (the one-shard tensors it decides, one cell each)
    world = 200
    tensors = {f"w{i}": ((world + 3 * i, 2), fsdp((world + 3 * i, 2), world)) for i in range(5)}
    alone = {f"u{r}": ((2,), [((0,), (2,), r)]) for r in range(world)}
    md, results, _ = save(world, tensors | alone)
    assert compare(md, results) == (world, 5 + world)
    same_record(md, results, monkeypatch)
    # 40 ranks: 40 parts, few enough for the batched path, which then decides as the oracle
    md, results, _ = save(
        40, {"w": ((80, 2), fsdp((80, 2), 40))} | {f"u{r}": ((2,), [((0,), (2,), r)]) for r in range(40)}
    )
    assert compare(md, results) == (41, 41)
    same_record(md, results, monkeypatch)


def test_per_rank_objects_leave_the_ranks_in_one_group(monkeypatch):
    # every rank holds its own object (rank-unique keys, as the manager's generator state):
    # own items, which do not enter the shards' groups, so the tensors are decided in batch
    world = 200
    tensors = {f"w{i}": ((world + 3 * i, 2), fsdp((world + 3 * i, 2), world)) for i in range(5)}
    md, results, _ = save(world, tensors, {f"rng.rank{r}": [r] for r in range(world)})
    assert compare(md, results) == (5, 5)
    same_record(md, results, monkeypatch)


@pytest.mark.parametrize("members", [1, 64, 65, 300])
def test_group_columns_are_each_members_row_with_its_file_base(members):
    """``Group.column(p)``, for the tensors the batched path leaves open: row ``p`` of every
    member side by side, its file index shifted by the member's base, whether the group stacks
    every row (small), gathered the open positions at once, or gathers one position alone."""
    rng = np.random.default_rng(members)
    tables = [rng.integers(0, 1000, (7, 6), dtype=np.int64) for _ in range(members)]
    bases = np.cumsum(rng.integers(1, 5, members), dtype=np.int64)
    before = [t.copy() for t in tables]
    want = np.stack(tables, axis=2)
    want[:, group_grids.FILE, :] += bases
    gathered = group_grids.Group(tables, bases)
    gathered.gather([5, 2, 5])
    alone = group_grids.Group(tables, bases)
    for p in range(7):
        assert np.array_equal(gathered.column(p), want[p]), p
        assert np.array_equal(alone.column(p), want[p]), p
    assert all(np.array_equal(t, c) for t, c in zip(tables, before))  # the ranks' tables stay as they were
