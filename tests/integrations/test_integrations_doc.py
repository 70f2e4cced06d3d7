"""docs/integrations.md's Lightning example runs as written (its paths moved into a temporary
directory), and the checkpoint it leaves is one of ours that verifies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from goodput_ckpt.format.manifest import MANIFEST_NAME  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def test_lightning_example_runs(tmp_path, capsys):
    section = PAGE.read_text().split("## PyTorch Lightning", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/integrations.md lost its Lightning example"
    code = blocks[0].replace("/tmp/lightning-ckpts", str(tmp_path / "ckpts"))
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    assert namespace["resumed"].global_step == 12
    assert capsys.readouterr().out.strip().splitlines()[-1] == "12"
    assert (tmp_path / "ckpts" / "last.ckpt" / MANIFEST_NAME).is_file()

    from goodput_ckpt.tools.ops.verify import verify_checkpoint

    assert verify_checkpoint(str(tmp_path / "ckpts" / "last.ckpt")).ok
