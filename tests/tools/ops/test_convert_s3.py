"""convert writes its sequential outputs (dcp, safetensors) on S3, whose sinks take only whole
parts, and reads them back exactly (a real local S3 server, moto)."""

from __future__ import annotations

import pytest
import torch
from helpers.samples import sample_state, save
from helpers.trees import assert_tree_equal

from goodput_ckpt.tools.ops.convert import convert_checkpoint


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    """A checkpoint whose outputs span several S3 parts (a 12 MB tensor) plus the usual sample."""
    state = sample_state()
    state["model"]["big"] = torch.randn(3_000_000)
    path = tmp_path_factory.mktemp("s3src") / "ckpt"
    return path, save(path, state)


@pytest.mark.parametrize(
    "to,dst,kw",
    [
        ("dcp", "dcp", {}),
        ("safetensors", "hf", {"shard_size": 5 << 20}),
        ("safetensors", "one/model.safetensors", {}),
    ],
)
def test_outputs_written_in_order_work_on_s3(big_ckpt, moto, tmp_path, to, dst, kw):
    src, sd = big_ckpt
    uri = moto.uri(dst)
    report = convert_checkpoint(str(src), uri, to=to, dst_options=moto.options(), **kw)
    assert report.files and moto.open_uploads() == []
    back = tmp_path / "back.pt"
    convert_checkpoint(uri, str(back), to="torch", src_options=moto.options())
    assert_tree_equal(torch.load(back, weights_only=True), sd)
