"""benchmarks/bench_loop.py stays runnable: a tiny run (a 2-layer model, 6 steps, a kill after
step 5, one repeat). No assertion is about speed: both writers ran the killed and the resumed
run, each restored a complete checkpoint from before the kill, and the scratch directory is gone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_loop  # noqa: E402

pytestmark = [pytest.mark.slow]


def test_tiny_run_kills_resumes_and_reports_both_writers(tmp_path, capsys):
    out = tmp_path / "loop.json"
    argv = [
        "--steps",
        "6",
        "--every",
        "2",
        "--kill-at",
        "5",
        "--width",
        "32",
        "--layers",
        "2",
        "--repeats",
        "1",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert bench_loop.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop.json"]
    report = json.loads(out.read_text())
    methods = ["torch", "ours", "ours-buffered"]
    assert report["order"] == [methods]
    for method in methods:
        fig = report["methods"][method]
        # Above 0; not bounded by 1: the useful time is a median of noisy steps, and on a loaded
        # machine a run's steps can all be faster than those it was measured from.
        assert fig["goodput"]["median"] > 0
        # Saves at steps 2 and 4; the kill after step 5 leaves step 2 or 4 as the last complete one.
        assert fig["lost"]["median"] in (1, 3)
        assert fig["stall_median"]["median"] > 0 and fig["background_median"]["median"] > 0
    assert all(report["ours_vs_torch"][m]["goodput"]["median"] > 0 for m in methods[1:])
    text = capsys.readouterr().out
    assert "load average" in text and "goodput" in text


def test_rejects_a_kill_before_the_first_save(capsys):
    with pytest.raises(SystemExit):
        bench_loop.main(["--steps", "6", "--every", "4", "--kill-at", "3"])
    assert "--kill-at" in capsys.readouterr().err
