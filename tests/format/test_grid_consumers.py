"""A small manifest describing millions of grid cells costs its consumers O(runs) (issue 33).

The manifest is ``_manifests.many_cells_manifest``: about 186 KB, one grid of 4 M one-byte
cells over 1,024 files, at a location that holds only the manifest (every file missing, so
every report names the keys of every file). Before the fix, ``verify --quick`` expanded every
cell into a record to name those keys (10-60 s, about 500 MB) and ``Manifest.tensor_bytes()``
walked every cell. Counted here: cells made into records (``GridChunks.__getitem__``), cell
boxes computed (``GridChunks.box``, one per run is the budget), and the peak of Python's
allocations (``tracemalloc``; a grid's index arrays are numpy buffers, traced too).
"""

from __future__ import annotations

import tracemalloc

import pytest
from _manifests import many_cells_manifest

from goodput_ckpt import CheckpointReader
from goodput_ckpt.errors import CorruptCheckpointError
from goodput_ckpt.format.grid import GridChunks
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.tools.ops.inspect import inspect_checkpoint
from goodput_ckpt.tools.ops.reshard import reshard_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint

FILES, RUNS = 1024, 4096
#: Peak of Python allocations a consumer may reach on this 186 KB manifest: parsing it takes
#: about 8x its size (docs/format.md), the run index 48 bytes a run, the report a message per
#: file: about 2.3 MiB measured. Expanding the cells took about 500 MB.
PEAK_BYTES = 8 << 20


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    root = tmp_path_factory.mktemp("many-cells")
    (root / MANIFEST_NAME).write_bytes(many_cells_manifest(FILES, RUNS))
    return str(root)


@pytest.fixture
def counted(monkeypatch):
    """Counts of cells made into records and of cell boxes computed, during the test."""
    counts = {"cells": 0, "boxes": 0}
    getitem, box = GridChunks.__getitem__, GridChunks.box

    def counted_getitem(self, k):
        counts["cells"] += 1
        return getitem(self, k)

    def counted_box(self, cell):
        counts["boxes"] += 1
        return box(self, cell)

    monkeypatch.setattr(GridChunks, "__getitem__", counted_getitem)
    monkeypatch.setattr(GridChunks, "box", counted_box)
    return counts


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_manifest_is_small_and_describes_4m_cells():
    assert 150_000 < len(many_cells_manifest(FILES, RUNS)) < 250_000


@pytest.mark.parametrize("quick", [True, False])
def test_verify_names_every_missing_file_without_expanding_cells(location, counted, quick):
    report, peak = _peak(lambda: verify_checkpoint(location, quick=quick))
    assert report.status == "corrupt"
    assert len(report.problems) == FILES
    assert all(p.kind == "missing" and p.keys == ["w"] for p in report.problems)
    assert counted["cells"] == 0
    assert counted["boxes"] <= 2 * RUNS  # one per run to parse, one per run to index
    assert peak < PEAK_BYTES, peak


def test_inspect_reports_every_missing_file_without_expanding_cells(location, counted):
    report, peak = _peak(lambda: inspect_checkpoint(location))
    assert len(report.problems) == FILES and report.tensor_bytes == FILES * RUNS
    assert counted["cells"] == 0 and counted["boxes"] <= 2 * RUNS
    assert peak < PEAK_BYTES, peak


def test_a_load_refuses_missing_files_before_expanding_cells(location, counted):
    """The reader checks every file's size against the manifest before DCP plans anything:
    only cells whose bytes are really there are ever expanded (by the planner, per read)."""
    reader = CheckpointReader(location)
    with pytest.raises(CorruptCheckpointError, match="is missing; keys stored in it: w"):
        _peak(reader.read_metadata)
    assert counted["cells"] == 0 and counted["boxes"] <= 2 * RUNS


def test_reshard_refuses_missing_files_before_expanding_cells(location, counted, tmp_path):
    with pytest.raises(CorruptCheckpointError, match="is missing; keys stored in it: w"):
        reshard_checkpoint(location, str(tmp_path / "out"), world_size=2)
    assert counted["cells"] == 0 and counted["boxes"] <= 2 * RUNS
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
