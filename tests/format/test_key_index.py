"""The key index (format/key_index.py): the keys a report names for a byte range, found run by
run, never cell by cell (issue 33), with the same answer as expanding every cell."""

from __future__ import annotations

import json
import random

from _manifests import many_cells_manifest

from goodput_ckpt.format.grid import GridChunks
from goodput_ckpt.format.key_index import KeyIndex
from goodput_ckpt.format.manifest import ObjectEntry, TensorEntry, parse_manifest, seal_manifest


def _oracle(manifest, file: str, lo: int, hi: int) -> list[str]:
    """The keys overlapping ``[lo, hi)`` of ``file``, every chunk and cell expanded."""
    found = []
    for key, e in manifest.items.items():
        pieces = (
            [(e.file, e.offset, e.length)]
            if isinstance(e, ObjectEntry)
            else [(c.file, c.offset, c.length) for c in e.chunks]
        )
        for f, off, length in pieces:
            if f == file and off < hi and lo < off + max(length, 1):
                found.append((off, key))
    out = []
    for _, key in sorted(found, key=lambda p: p[0]):
        if key not in out:
            out.append(key)
    return out


def _random_manifest(rng: random.Random) -> bytes:
    """Grids of random shapes and blocks over a few files (runs in random file progressions,
    packed into each file's next free bytes), plus an explicit tensor and an object."""
    files = [f"f{i}.bin" for i in range(rng.randrange(2, 7))]
    ends = [0] * len(files)
    items = {}
    for t in range(rng.randrange(1, 6)):
        ndim = rng.randrange(1, 3)
        shape = [rng.randrange(1, 7) for _ in range(ndim)]
        block = [rng.randrange(1, s + 1) for s in shape]
        counts = [-(-s // b) for s, b in zip(shape, block)]
        cells = [[]]
        for c in counts:
            cells = [x + [i] for x in cells for i in range(c)]
        runs, k = [], 0
        while k < len(cells):
            size = lambda idx: [min(b, s - i * b) for i, b, s in zip(idx, block, shape)]  # noqa: E731
            n = 1
            while k + n < len(cells) and size(cells[k + n]) == size(cells[k]) and n < len(files) and rng.random() < 0.7:
                n += 1
            step = rng.randrange(1, max(2, len(files) // n + 1)) if n > 1 else 1
            first = rng.randrange(0, len(files) - step * (n - 1))
            length = 1
            for s in size(cells[k]):
                length *= s
            length *= 4
            offset = max(ends[first + step * j] for j in range(n))
            offset = -(-offset // 64) * 64
            for j in range(n):
                ends[first + step * j] = offset + length
            runs.append([n, first, step, offset])
            k += n
        items[f"t{t}"] = {
            "kind": "tensor",
            "dtype": "float32",
            "shape": shape,
            "requires_grad": False,
            "grid": {"block": block, "runs": runs},
        }
    for key, length in (("explicit", 12), ("obj", 100)):
        f = rng.randrange(len(files))
        offset = -(-ends[f] // 64) * 64
        ends[f] = offset + length
        if key == "obj":
            items[key] = {
                "kind": "object",
                "encoding": "torch.save",
                "file": files[f],
                "offset": offset,
                "length": length,
            }
        else:
            items[key] = {
                "kind": "tensor",
                "dtype": "float32",
                "shape": [3],
                "requires_grad": False,
                "chunks": [{"offsets": [0], "sizes": [3], "file": files[f], "offset": offset, "length": 12}],
            }
    doc = {
        "format": "goodput-ckpt",
        "version": 2,
        "world_size": len(files),
        "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": 1 << 30},
        "files": {n: {"size": max(e, 1), "chunks": ["0" * 64]} for n, e in zip(files, ends)},
        "items": items,
    }
    return seal_manifest(json.dumps(doc).encode())


def test_same_keys_as_expanding_every_cell():
    rng = random.Random(33)
    for _ in range(150):
        m = parse_manifest(_random_manifest(rng))
        index = KeyIndex(m)
        for f in m.files.values():
            for _ in range(6):
                lo = rng.randrange(0, f.size + 64)
                hi = lo + rng.randrange(1, f.size + 1)
                assert index.keys(f.path, lo, hi) == _oracle(m, f.path, lo, hi), (f.path, lo, hi)
            assert index.keys(f.path, 0, f.size) == _oracle(m, f.path, 0, f.size)
        assert index.keys("absent.bin", 0, 1 << 20) == []
        assert index.unresolved == 0


def test_a_grid_of_4m_cells_is_looked_at_run_by_run(monkeypatch):
    """The issue's manifest: 1,024 files x 4,096 runs of one-byte cells. Each whole-file query
    scans each run once (C speed) and expands no cell; the grid's one key is named."""
    files, runs = 1024, 4096
    m = parse_manifest(many_cells_manifest(files, runs))
    expanded = []
    monkeypatch.setattr(GridChunks, "__getitem__", lambda self, k: expanded.append(k))
    index = KeyIndex(m)
    for f in list(m.files.values())[:64]:
        assert index.keys(f.path, 0, f.size) == ["w"]
    assert index.keys("data_00007.bin", 64 * 100, 64 * 100 + 1) == ["w"]
    assert expanded == []
    assert index.work <= 64 * runs + runs, index.work


def test_past_its_budget_the_index_names_explicit_keys_only():
    m = parse_manifest(_random_manifest(random.Random(5)))
    index = KeyIndex(m, budget=0)
    grids = {k for k, e in m.items.items() if isinstance(e, TensorEntry) and isinstance(e.chunks, GridChunks)}
    for f in m.files.values():
        assert set(index.keys(f.path, 0, f.size)) == set(_oracle(m, f.path, 0, f.size)) - grids
    assert index.unresolved > 0 and index.work == 0


def test_tensor_bytes_expands_no_cell(monkeypatch):
    m = parse_manifest(many_cells_manifest(1024, 4096))
    expanded = []
    monkeypatch.setattr(GridChunks, "__getitem__", lambda self, k: expanded.append(k))
    assert m.tensor_bytes() == 1024 * 4096
    assert expanded == []


def test_the_budget_covers_a_real_16k_rank_record_with_every_file_missing():
    """The 70B record with its training state at 16,384 ranks (benchmarks/bench_scale.py's
    simulation): 16,384 files, 6,527 runs. Whole-file queries for every file scan at most every
    run each (70 M run-elements were measured, docs/scale.md's shape); the cap leaves room."""
    from goodput_ckpt.format.key_index import MAX_KEY_INDEX_WORK

    assert 16_384 * 6_527 < MAX_KEY_INDEX_WORK
