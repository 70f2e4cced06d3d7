"""``goodput-ckpt demo --uri s3://...``: the whole kill-and-resume story with checkpoints on S3
(moto on 127.0.0.1; the ranks get the endpoint through the demo's store options)."""

from __future__ import annotations

import pytest

from goodput_ckpt.tools.demos.demo import DemoConfig, run_demo

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(600)
def test_demo_on_s3_resumes_bit_exactly(moto, tmp_path):
    cfg = DemoConfig(
        workdir=str(tmp_path / "demo"),
        uri=moto.uri("demo"),
        storage_options=moto.options(),
        steps=16,
        save_every=4,
        width=64,
        kill_at=8,
    )
    report = run_demo(cfg)
    assert report.ok and report.bit_exact, report.mismatches
    assert report.restored_step in (4, 8)
    assert [c["step"] for c in report.checkpoints][-1] == 15
    assert any(k.startswith("demo/step_00000015/") for k in moto.keys("demo/"))
    assert moto.open_uploads() == []
    assert not (tmp_path / "demo" / "checkpoints").exists()  # nothing landed locally


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tier_demo_on_s3_keeps_each_mode_under_its_own_prefix(moto, tmp_path):
    from goodput_ckpt.tools.demos.demo_tiers import run_tier_demo

    cfg = DemoConfig(
        workdir=str(tmp_path / "demo"),
        uri=moto.uri("demo"),
        storage_options=moto.options(),
        steps=16,
        save_every=4,
        width=64,
        kill_at=8,
        world_size=2,
        failure="job",
    )
    report = run_tier_demo(cfg)
    one, two = report.modes
    assert report.ok, (one.mismatches, two.mismatches)
    assert (one.root, two.root) == (moto.uri("demo/one-tier"), moto.uri("demo/two-tiers"))
    assert one.restored_from == ["persistent"] and two.restored_from == ["local"]
    keys = moto.keys("demo/")
    assert any(k.startswith("demo/one-tier/step_00000015/") for k in keys)
    assert any(k.startswith("demo/two-tiers/step_") for k in keys)  # every 3rd save of a launch
    assert not (tmp_path / "demo" / "one-tier" / "checkpoints").exists()  # the roots are on S3
    assert moto.open_uploads() == []
