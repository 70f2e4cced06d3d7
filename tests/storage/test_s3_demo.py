"""``goodput-ckpt demo --uri s3://...``: the whole kill-and-resume story with checkpoints on S3
(moto on 127.0.0.1; the ranks get the endpoint through the demo's store options)."""

from __future__ import annotations

import pytest

from goodput_ckpt.tools.demo import DemoConfig, run_demo

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(600)
def test_demo_on_s3_resumes_bit_exactly(moto, tmp_path):
    cfg = DemoConfig(
        workdir=str(tmp_path / "demo"), uri=moto.uri("demo"), storage_options=moto.options(),
        steps=16, save_every=4, width=64, kill_at=8,
    )  # fmt: skip
    report = run_demo(cfg)
    assert report.ok and report.bit_exact, report.mismatches
    assert report.restored_step in (4, 8)
    assert [c["step"] for c in report.checkpoints][-1] == 15
    assert any(k.startswith("demo/step_00000015/") for k in moto.keys("demo/"))
    assert moto.open_uploads() == []
    assert not (tmp_path / "demo" / "checkpoints").exists()  # nothing landed locally
