"""Grouping read tasks into per-file sequential runs (for stores with ``sequential_reads``)."""

from __future__ import annotations

from goodput_ckpt.engine.read_plan import MAX_RUNS_PER_FILE, Task, sequential_lanes

MiB = 1 << 20


def tasks(files: dict[str, int], size: int = 16 * MiB) -> list[Task]:
    return [Task(f, i * size, (i + 1) * size) for f, n in files.items() for i in range(n)]


def test_one_run_per_file_when_files_are_plenty():
    ts = tasks({"a": 4, "b": 3, "c": 4, "d": 1})
    lanes = sequential_lanes(ts, threads=8)
    assert [[t.file for t in lane] for lane in lanes] == [["a"] * 4, ["b"] * 3, ["c"] * 4, ["d"]]
    for lane in lanes:
        assert all(x.end == y.start for x, y in zip(lane, lane[1:])), "a run is read in order"


def test_few_files_are_cut_into_a_few_runs():
    lanes = sequential_lanes(tasks({"a": 8}), threads=8)
    assert len(lanes) == MAX_RUNS_PER_FILE == 2
    assert [len(lane) for lane in lanes] == [4, 4]
    assert [(t.file, t.start) for lane in lanes for t in lane] == [(t.file, t.start) for t in tasks({"a": 8})]
    assert len(sequential_lanes(tasks({"a": 8}), threads=1)) == 1
    assert sequential_lanes([], threads=8) == []
