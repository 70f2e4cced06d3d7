"""The README's quick start runs as written (with its paths moved into a temporary directory)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from goodput_ckpt.cli import main

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


def test_ls_lists_what_the_quick_start_saved(tmp_path):
    """``goodput-ckpt ls /tmp/ckpt`` after the quick start lists its steps (issue 20: it said
    "0 checkpoint(s)", since ``step_100`` is not the manager's ``step_00000100`` spelling)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    exec(compile(blocks[0].replace("/tmp/ckpt", str(tmp_path)), str(README), "exec"), {})  # noqa: S102
    out = io.StringIO()
    assert main(["ls", str(tmp_path), "--json"], stdout=out) == 0
    rows = json.loads(out.getvalue())["checkpoints"]
    assert [(r["step"], r["name"], r["status"]) for r in rows] == [
        (100, "step_100", "complete"),
        (200, "step_200", "complete"),
    ]
