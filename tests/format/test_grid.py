"""check_spans (format/grid.py): byte ranges inside their files and disjoint, for spans that
cover one file (v1 chunks, objects) or a progression of many (a v2 grid's run), against a
brute-force oracle that expands every span into its files."""

from __future__ import annotations

import random

import pytest
from helpers.seeds import for_each_seed

from goodput_ckpt.format.grid import GridChunks, GridError, check_spans


def _brute(spans, sizes) -> bool:
    """Whether every (span, file) range lies in its file and no two ranges of a file meet."""
    per_file: dict[int, list[tuple[int, int]]] = {}
    for offset, length, first, step, count, _ in spans:
        if not length:
            continue
        for k in range(count):
            f = first + step * k
            if offset + length > sizes[f]:
                return False
            per_file.setdefault(f, []).append((offset, offset + length))
    for ranges in per_file.values():
        ranges.sort()
        if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:])):
            return False
    return True


def _random_spans(rng: random.Random, files: int):
    spans = []
    for i in range(rng.randint(1, 12)):
        count = min(files, rng.choice([1, 1, 2, files // 2 or 1, files]))
        step = rng.randint(1, max(1, (files - 1) // max(1, count - 1))) if count > 1 else 1
        first = rng.randint(0, files - 1 - step * (count - 1))
        offset = rng.choice([0, 64, 128, 4096, 8192]) + 64 * rng.randint(0, 3)
        length = rng.choice([0, 64, 100, 4096])
        spans.append((offset, length, first, step, count, f"k{i}"))
    return spans


def _spans_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    files = rng.randint(1, 40)
    names = [f"f{i}" for i in range(files)]
    sizes = [rng.choice([4096, 8192, 12288, 20000]) for _ in range(files)]
    spans = _random_spans(rng, files)
    ok = _brute(spans, sizes)
    if ok:
        check_spans(list(spans), names, sizes)
    else:
        with pytest.raises(GridError):
            check_spans(list(spans), names, sizes)


def test_check_spans_matches_brute_force():
    for_each_seed(range(400), _spans_match_brute_force)


def test_overlap_inside_a_run_names_the_file_and_both_keys():
    names = [f"f{i}" for i in range(10)]
    spans = [(0, 4096, 0, 2, 5, "grid"), (4032, 64, 6, 1, 1, "obj")]  # file 6 is the run's 4th
    with pytest.raises(GridError, match=r"items 'grid' and 'obj' overlap in 'f6' at byte 4032") as info:
        check_spans(spans, names, [8192] * 10)
    assert info.value.key == "grid, obj"
    spans = [(64, 64, 7, 1, 1, "obj"), (0, 4096, 1, 3, 3, "grid")]  # the run starts first: files 1, 4, 7
    with pytest.raises(GridError, match=r"items 'grid' and 'obj' overlap in 'f7' at byte 64"):
        check_spans(spans, names, [8192] * 10)


def test_run_past_the_end_of_one_file_names_it():
    names = [f"f{i}" for i in range(6)]
    sizes = [8192, 8192, 8192, 4096, 8192, 8192]
    with pytest.raises(GridError, match=r"item 'g': byte range \[0, 8192\) lies beyond the end of 'f3' \(4096 bytes\)"):
        check_spans([(0, 8192, 1, 1, 5, "g")], names, sizes)
    check_spans([(0, 8192, 0, 2, 3, "g")], names, sizes)  # files 0, 2, 4 only


def test_entries_pickle_as_their_constructor_arguments():
    """A load's ranks get the parsed record pickled (dcp/manifest_share.py): every entry type
    comes back equal, of its own type, with what its constructor derives (a grid's counts and
    run starts) made again; a grid's file names are pickled once however many grids share them."""
    import pickle

    from goodput_ckpt.format.schema import ChunkEntry, FileEntry, ObjectEntry, TensorEntry

    names = tuple(f"rank{i}.bin" for i in range(50))
    # 2 to 4 cells each: one run, or one of all but the last cell and a run of one
    grids = [
        GridChunks(
            (5 * (2 + i % 3), 4),
            (5, 4),
            4,
            ((1 + i % 3, i, 1, 64), (1, 0, 1, 0)) if i % 2 else ((2 + i % 3, i, 1, 0),),
            names,
        )
        for i in range(40)
    ]
    chunk = ChunkEntry((0,), (3,), "rank0.bin", 0, 12)
    entries = [TensorEntry(f"t{i}", "float32", g.shape, g, bool(i % 2)) for i, g in enumerate(grids)]
    entries += [TensorEntry("c", "int64", (3,), (chunk,)), chunk, ObjectEntry("o", "torch.save", "rank1.bin", 0, 5)]
    entries += [FileEntry("rank0.bin", 100, ("ab" * 32,))]
    back = pickle.loads(pickle.dumps(entries))
    assert back == entries and [type(e) for e in back] == [type(e) for e in entries]
    for e, b in zip(entries[:40], back[:40]):
        assert (b.chunks.counts, b.chunks._starts, len(b.chunks), list(b.chunks)) == (
            e.chunks.counts,
            e.chunks._starts,
            len(e.chunks),
            list(e.chunks),
        )
    assert back[0].kind == "tensor" and back[-2].kind == "object"
    assert len(pickle.dumps(entries[:40])) < len(pickle.dumps(entries[:1])) + 40 * 200  # the names once
