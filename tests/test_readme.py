"""The README's quick start runs as written (with its paths moved into a temporary directory)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its quick start"
    code = blocks[0].replace("/tmp/ckpt", str(tmp_path))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert (tmp_path / "step_100" / "manifest.json").exists()
    assert (tmp_path / "step_200" / "manifest.json").exists()
    assert namespace["state"]["step"] == 100
