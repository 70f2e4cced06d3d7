"""The README's CheckpointManager example runs as written (its root moved into a temp dir), and
running it again resumes from its last checkpoint instead of starting over."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_manager_example_runs_and_resumes(tmp_path):
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if "CheckpointManager(" in b
    ]
    assert blocks, "README lost its CheckpointManager example"
    code = compile(blocks[0].replace('"/tmp/run"', repr(str(tmp_path / "run"))), str(README), "exec")
    first: dict = {}
    exec(code, first)  # noqa: S102 - our own README
    assert first["last"] is None and first["mgr"].steps() == [60, 80, 99]
    assert first["mgr"].extra(99)["lr"] == first["sched"].get_last_lr()[0]
    again: dict = {}
    exec(code, again)  # noqa: S102
    assert again["last"] == 99 and again["step"] == 100
    assert all((a == b).all() for a, b in zip(first["model"].parameters(), again["model"].parameters()))
