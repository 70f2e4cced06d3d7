"""benchmarks/bench_restore_layout.py and bench_restore_control.py stay runnable (issue 37): tiny
runs of real gloo processes (a model of 8 small layers, one repeat). No assertion is about speed:
every mode and phase was measured on every rank, the ratios are computed within each repeat, and
the order of the modes rotates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_restore_control  # noqa: E402
import bench_restore_layout  # noqa: E402

pytestmark = [pytest.mark.slow]


def test_control_runs_every_mode_with_its_phases(tmp_path, capsys):
    out = tmp_path / "control.json"
    argv = ["--world", "4", "--small", "2", "--layers", "8", "--repeats", "2", "--json", str(out)]
    assert bench_restore_control.main(argv) == 0
    fig = json.loads(out.read_text())
    assert fig["world"] == 4 and fig["small"] == 2 and fig["repeats"] == 2
    assert fig["order"] == [["big", "jobs", "one"], ["jobs", "one", "big"]]
    for mode in bench_restore_control.MODES:
        f = fig[mode]
        assert all(f[k]["min"] > 0 for k in ("ours", "process", "wall"))
        assert set(f["phases"]) == {*bench_restore_control.PHASES, "other"}
        assert f["phases"]["parse"] > 0 and f["phases"]["plan"] > 0 and f["phases"]["hash"] > 0
        assert len(f["rank_medians"]["ours"]) == (2 if mode == "one" else 4)
        # dcp.load's collectives were counted on every rank (counts, not times)
        assert all(c > 0 for c in f["rank_medians"]["collective calls"])
        assert all(b > 0 for b in f["rank_medians"]["collective bytes"])
    assert all(v["median"] > 0 for v in fig["ratios"].values())
    text = capsys.readouterr().out
    assert "load average at start" in text and "big/jobs ours" in text


def test_control_refuses_a_world_that_is_not_a_multiple():
    with pytest.raises(ValueError, match="multiple"):
        bench_restore_control.run(world=3, small=2, layers=1, repeats=1)


def test_layout_run_reports_every_rank(tmp_path, capsys):
    out = tmp_path / "layout.json"
    argv = ["--worlds", "2", "--layers", "8", "--repeats", "2", "--json", str(out)]
    assert bench_restore_layout.main(argv) == 0
    (fig,) = json.loads(out.read_text())["figures"]
    assert fig["world"] == 2 and fig["items"] > 0
    new = fig["new"]
    assert new["record"]["grid_runs"] > 0
    assert all(new[f"alone_{k}"]["min"] > 0 for k in ("cpu_s", "wall_s", "thread_cpu_s"))
    assert len(new["alone_thread_cpu_s_rank_medians"]) == 2
    assert "rank medians, alone thread_cpu_s" in capsys.readouterr().out
