"""GridRuns (format/grid_runs.py): every grid's runs of a manifest checked at once.

- The Python work of a parse does not grow with the ranks on a real FSDP2 layout of small
  tensors (issue 37, "Restore on a real layout"): the same tensors at 2 and at 8 ranks, whose
  records hold 2.5x the runs at 8, make the same number of Python calls (counted with
  ``sys.setprofile``, not timed). Before, each run cost a few calls (its fields, its first cell's
  box, a sweep step).
- The record itself does not grow with the ranks on that layout as the writer lays it out now
  (``engine/layout.py``: a tensor's shards at one offset in every rank's file): counted in grid
  runs, the rows the parse converts and checks at C speed, and in record bytes. Before, each
  rank's uneven and empty shards moved every later item, and the runs grew 2.5x from 2 to 8 ranks.
- The array checks decide as the reference run loop (``grid.check_runs``) does, and a bad run is
  refused with the reference's message, on random valid and damaged runs.
- ``check_spans``'s expanded path agrees with the sweep and with a brute-force oracle.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
from helpers.seeds import for_each_seed

from goodput_ckpt.engine.layout import ShardShape, rank_placements
from goodput_ckpt.errors import CorruptCheckpointError
from goodput_ckpt.format import grid as grid_module
from goodput_ckpt.format.grid import GridChunks, GridError, check_runs, check_spans, spans_of
from goodput_ckpt.format.grid_detect import grid_from_rows
from goodput_ckpt.format.grid_runs import GridRuns, plain_runs
from goodput_ckpt.format.manifest import seal_manifest
from goodput_ckpt.format.parse import parse_manifest

ROWS = (3, 5, 7, 9, 13, 17, 33, 50)  # as benchmarks/bench_restore_layout.py: uneven, and empty shards


def fsdp_small_manifest(world: int, layers: int = 60) -> bytes:
    """:func:`fsdp_small_doc`, sealed."""
    return seal_manifest(json.dumps(fsdp_small_doc(world, layers), separators=(",", ":")).encode())


def fsdp_small_doc(world: int, layers: int) -> dict:
    """The record of an FSDP2 + AdamW save of ``layers`` small ``Linear(16, rows)`` layers on
    ``world`` ranks, laid out as the writer lays out a rank's file: each rank's shards in order,
    64-byte aligned, rank 0's file led by the small replicated values it keeps. A tensor's cell
    ``k`` is rank ``k``'s shard (torch's chunk rule: ``ceil(rows / world)`` rows, ranks past the
    end hold nothing), each at its own offset: one run per cell, as in a real save."""
    names = [f"rank{r:05d}-00.0123456789ab.bin" for r in range(world)]
    ends = [4096] + [0] * (world - 1)  # rank 0: the replicated values first
    items: dict = {}
    for layer in range(layers):
        rows = ROWS[layer % len(ROWS)]
        for what in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            for shape in ((rows, 16), (rows,)):
                key = f"{what}.layers.{layer}.{'weight' if len(shape) == 2 else 'bias'}"
                block = -(-rows // world)
                runs = []
                for k in range(-(-rows // block)):
                    nbytes = min(block, rows - k * block) * (16 if len(shape) == 2 else 1) * 4
                    runs.append([1, k, 1, ends[k]])
                    ends[k] += -(-nbytes // 64) * 64
                items[key] = {
                    "kind": "tensor",
                    "dtype": "float32",
                    "shape": list(shape),
                    "requires_grad": False,
                    "grid": {"block": [block, *shape[1:]], "runs": runs},
                }
    return {
        "format": "goodput-ckpt",
        "version": 2,
        "world_size": world,
        "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": 1 << 30},
        "files": {n: {"size": max(e, 64), "chunks": ["0" * 64]} for n, e in zip(names, ends)},
        "items": items,
    }


def writer_layout_manifest(world: int, layers: int = 60) -> bytes:
    """The record of the save :func:`fsdp_small_doc` describes, with each rank's file laid out
    by the writer's own function (``engine.layout.rank_placements``: rank 0 keeps the replicated
    values, and ranks past a tensor's end hold no item for it, as the save planner leaves them)
    and each tensor's grid found by the commit's own detector (``grid_from_rows``)."""
    names = [f"rank{r:05d}-00.0123456789ab.bin" for r in range(world)]
    shapes = {}
    for layer in range(layers):
        rows = ROWS[layer % len(ROWS)]
        for what in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            for shape in ((rows, 16), (rows,)):
                shapes[f"{what}.layers.{layer}.{'weight' if len(shape) == 2 else 'bias'}"] = shape
    boxes: dict[str, list] = {key: [] for key in shapes}  # per tensor: (file, offset, length, box)
    file_sizes = []
    for rank in range(world):
        shards = []
        for shape in shapes.values():
            block = -(-shape[0] // world)
            start = min(rank * block, shape[0])
            shards.append(ShardShape(shape, (start, 0)[: len(shape)], (min(block, shape[0] - start), *shape[1:]), 4))
        keys = [k for k, s in zip(shapes, shards) if s.sizes[0]]  # the save planner drops empty shards
        shards = [s for s in shards if s.sizes[0]]
        own = [1261] * 5 + [31469] if rank == 0 else []  # the replicated values rank 0 keeps
        sizes = own + [4 * int(np.prod(s.sizes)) for s in shards]
        placements, ends = rank_placements(sizes, [None] * len(own) + shards, 1, world)
        file_sizes.append(max(ends[0], 64))
        for key, shard, p in zip(keys, shards, placements[len(own) :]):
            boxes[key].append((rank, p.offset, p.length, shard.offsets, shard.sizes))
    items = {}
    for key, shape in shapes.items():
        f, o, n, bo, bs = (np.array([b[i] for b in boxes[key]], dtype=np.int64) for i in range(5))
        grid = grid_from_rows(shape, 4, f, o, n, bo, bs, names)
        assert grid is not None
        items[key] = {"kind": "tensor", "dtype": "float32", "shape": list(shape), "grid": grid.to_json()}
    doc = fsdp_small_doc(world, 0)
    doc["files"] = {n: {"size": size, "chunks": ["0" * 64]} for n, size in zip(names, file_sizes)}
    doc["items"] = items
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())


def _runs(record: bytes) -> int:
    return sum(len(e.chunks.runs) for e in parse_manifest(record).items.values())


def test_the_record_does_not_grow_with_ranks_on_the_writers_layout():
    records = {w: writer_layout_manifest(w) for w in (2, 8)}
    runs = {w: _runs(r) for w, r in records.items()}
    cells = {w: sum(len(e.chunks) for e in parse_manifest(r).items.values()) for w, r in records.items()}
    assert cells[8] > 2 * cells[2]  # the shards do grow with the ranks
    assert runs[8] <= runs[2], runs  # the rows the parse works on do not (before: 1,758 against 720)
    file_table = {w: len(json.dumps(json.loads(r)["files"])) for w, r in records.items()}
    assert len(records[8]) - file_table[8] <= len(records[2]) - file_table[2], (len(records[2]), len(records[8]))
    for r in records.values():
        parse_manifest(r)  # warm: imports, caches
    calls = {w: _python_calls(lambda r=r: parse_manifest(r)) for w, r in records.items()}
    assert calls[8] - calls[2] <= 12 * (8 - 2), calls


def _python_calls(fn) -> int:
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":  # Python functions and generator resumptions, not C calls
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_parse_work_in_python_does_not_grow_with_ranks():
    records = {w: fsdp_small_manifest(w) for w in (2, 8)}
    runs = {w: sum(len(e.chunks.runs) for e in parse_manifest(r).items.values()) for w, r in records.items()}
    assert runs[8] > 2 * runs[2]  # the layout this is about: runs grow with the ranks
    for r in records.values():
        parse_manifest(r)  # warm: imports, caches
    calls = {w: _python_calls(lambda r=r: parse_manifest(r)) for w, r in records.items()}
    # What still grows is the file table (one file per rank: its name, size and digests).
    assert calls[8] - calls[2] <= 12 * (8 - 2), (calls, runs)


def test_real_layouts_take_the_array_paths(monkeypatch):
    reference, sweeps = [], []
    monkeypatch.setattr("goodput_ckpt.format.grid_runs.check_runs", lambda *a: reference.append(a))
    expanded = grid_module._disjoint_expanded
    monkeypatch.setattr(grid_module, "_disjoint_expanded", lambda *a: sweeps.append(expanded(*a)) or sweeps[-1])
    parse_manifest(fsdp_small_manifest(8))
    assert reference == [] and sweeps == [True]


# -- the array checks against the reference --------------------------------------------------------
def _random_grid(rng: random.Random, files: int) -> tuple[tuple[int, ...], tuple[int, ...], list[list[int]]]:
    dims = rng.randint(1, 3)
    shape = tuple(rng.randint(1, 9) for _ in range(dims))
    block = tuple(rng.randint(1, s) for s in shape)
    counts = tuple(-(-s // b) for s, b in zip(shape, block))
    cells = 1
    for c in counts:
        cells *= c
    runs, n = [], 0
    while n < cells:
        count = rng.randint(1, cells - n)
        step = rng.randint(1, 3)
        runs.append([count, rng.randint(0, files - 1), step, 64 * rng.randint(0, 40)])
        n += count
    if rng.random() < 0.5:  # damage one field of one run, or drop or add a run
        run = rng.choice(runs)
        what = rng.randrange(6)
        if what < 4:
            run[what] = rng.choice([-1, 0, 1, 2, 7, files, 10**6, 65, 2**62, 2**70])
        elif what == 4 and len(runs) > 1:
            runs.pop()
        else:
            runs.append([1, 0, 1, 0])
    return shape, block, runs


def _same_verdict(seed: int) -> None:
    rng = random.Random(seed)
    files = rng.randint(1, 12)
    names = [f"f{i}" for i in range(files)]
    grids = []
    for g in range(rng.randint(1, 4)):
        shape, block, runs = _random_grid(rng, files)
        grids.append((f"g{g}", shape, block, runs))
    expected: list = []
    error = None
    try:
        for key, shape, block, runs in grids:
            counts = tuple(-(-s // b) for s, b in zip(shape, block))
            made = check_runs([list(r) for r in runs], shape, block, counts, files, key)
            expected.extend(spans_of(GridChunks(shape, block, 4, made, names), key))
    except GridError as e:
        error = str(e)
    others: list = []
    batch = GridRuns(names, others)
    for key, shape, block, runs in grids:
        assert plain_runs(runs)
        batch.add(key, GridChunks(shape, block, 4, tuple(map(tuple, runs)), names))
    if error is None:
        assert batch.merged() == expected
    else:
        with pytest.raises(GridError) as info:
            batch.merged()
        assert str(info.value) == error


def test_array_checks_decide_as_the_reference():
    for_each_seed(range(600), _same_verdict)


def test_plain_runs_refuses_what_the_arrays_cannot_hold():
    assert plain_runs([[1, 0, 1, 0]])
    for bad in ([[1, 0, 1]], [[1, 0, 1, 0.0]], [[True, 0, 1, 0]], [(1, 0, 1, 0)], "x", [[1, 0, 1, "0"]]):
        assert not plain_runs(bad)


def test_a_damaged_run_in_a_record_names_the_item_and_run():
    body = fsdp_small_doc(4, layers=20)
    body["items"]["model.layers.7.weight"]["grid"]["runs"][2][3] = 96  # not a multiple of 64
    damaged = seal_manifest(json.dumps(body, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match=r"'model.layers.7.weight' grid run 2: byte offset 96"):
        parse_manifest(damaged)


# -- check_spans: the expanded path -----------------------------------------------------------------
def _spans_agree(seed: int) -> None:
    rng = random.Random(seed)
    files = rng.randint(1, 20)
    names = [f"f{i}" for i in range(files)]
    sizes = [rng.choice([4096, 8192, 20000]) for _ in range(files)]
    spans = []
    for i in range(rng.randint(64, 120)):
        count = rng.choice([1, 1, 1, 2, 3])
        count = min(count, files)
        step = rng.randint(1, max(1, (files - 1) // max(1, count - 1))) if count > 1 else 1
        first = rng.randint(0, files - 1 - step * (count - 1))
        spans.append((64 * rng.randint(0, 300), rng.choice([0, 64, 100, 128]), first, step, count, f"k{i}"))
    expanded = grid_module._disjoint_expanded(list(spans), sizes)
    saved, grid_module._EXPAND_MIN_SPANS = grid_module._EXPAND_MIN_SPANS, 10**9  # the sweep alone
    try:
        check_spans(list(spans), names, sizes)
        swept = True
    except GridError:
        swept = False
    finally:
        grid_module._EXPAND_MIN_SPANS = saved
    assert expanded == swept


def test_expanded_span_check_agrees_with_the_sweep():
    for_each_seed(range(300), _spans_agree)
