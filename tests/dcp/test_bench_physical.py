"""benchmarks/bench_physical.py stays runnable: a tiny run (4 MiB, one repeat, with the phase
timers). No assertion is about speed: every method ran, the ratios are computed within the repeat,
the timers were removed afterwards, and the scratch directory is gone."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_physical  # noqa: E402

import goodput_ckpt.dcp.writer as writer_mod  # noqa: E402
import goodput_ckpt.storage.local_sink as sink_mod  # noqa: E402

pytestmark = [pytest.mark.slow]


def test_tiny_run_reports_ratios_and_phases(tmp_path, capsys):
    before = (os.pwritev, os.pwrite, sink_mod._SYNC_FILE_RANGE, writer_mod.write_hashed_files)
    out = tmp_path / "physical.json"
    argv = [
        "--size",
        "4MiB",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--phases",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
        "--load",
        "1,1",
        "--settle",
        "0",
    ]
    assert bench_physical.main(argv) == 0
    assert (os.pwritev, os.pwrite, sink_mod._SYNC_FILE_RANGE, writer_mod.write_hashed_files) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["physical.json"]
    report = json.loads(out.read_text())
    methods = ["raw", "ours", "ours-buffered", "ours-direct", "ours-t1"]
    assert list(report["seconds"]) == methods and report["order"] == [methods]
    assert report["vs_raw"]["raw"]["median"] == 1.0
    assert all(v["median"] > 0 for v in report["vs_raw"].values())
    assert list(report["full_gc"]) == methods and all(len(v) == 1 and v[0] >= 0 for v in report["full_gc"].values())
    parts = report["phases"][0]["parts"]
    assert parts["write_hashed_files (wall)"]["calls"] == 1 and parts["blake3 (thread-s)"]["calls"] > 0
    text = capsys.readouterr().out
    assert "load average" in text and "raw/method" in text
    assert report["artificial_load"] == "1,1" and "auto ->" in report["regimes"][0]
    pids = [int(p) for p in text.split("PIDs [")[1].split("]")[0].split(",")]
    assert len(pids) == 2  # one busy loop and the page-cache churner, stopped at the end:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
