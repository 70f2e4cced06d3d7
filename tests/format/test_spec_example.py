"""The format spec's own reader example (docs/format.md) reads what CheckpointWriter wrote."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter

SPEC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def _spec_reader():
    blocks = re.findall(r"```python\n(.*?)```", SPEC.read_text(), flags=re.S)
    assert blocks, "docs/format.md lost its example"
    namespace: dict = {}
    exec(compile(blocks[-1], str(SPEC), "exec"), namespace)  # noqa: S102 - our own doc
    return namespace["read_tensor"]


def test_spec_example_reads_a_checkpoint(tmp_path):
    read_tensor = _spec_reader()
    sd = {"w": torch.randn(300, 70), "i": torch.arange(12, dtype=torch.int64).reshape(3, 4), "s": torch.tensor(2.5)}
    dcp.save(sd, storage_writer=CheckpointWriter(tmp_path, chunk_size=1 << 12))
    for key, t in sd.items():
        np.testing.assert_array_equal(read_tensor(str(tmp_path), key), t.numpy())
