"""Retention policy and step scanning on a real local root (goodput_ckpt/manager/retention.py)."""

from __future__ import annotations

import subprocess
import sys

from goodput_ckpt.manager.retention import delete_step, retention_victims, scan_steps
from goodput_ckpt.storage import open_store


def _root(tmp_path, complete, incomplete):
    for s in complete + incomplete:
        d = tmp_path / f"step_{s:08d}"
        d.mkdir()
        (d / "rank00000-00.0123456789ab.bin").write_bytes(b"data")
        if s in complete:
            (d / "manifest.json").write_text("{}")
    (tmp_path / "step_7").mkdir()  # not a canonical step name: ignored
    (tmp_path / "step_7" / "x").write_text("")
    return open_store(str(tmp_path))


def test_scan_and_policy(tmp_path):
    scan = scan_steps(_root(tmp_path, complete=[10, 20, 30, 40], incomplete=[5, 35, 50]))
    assert scan.complete == [10, 20, 30, 40] and scan.incomplete == [5, 35, 50] and scan.latest == 40
    assert retention_victims(scan, committed=40, keep_last=2) == [5, 10, 20, 35]
    assert retention_victims(scan, committed=40, keep_last=None) == [5, 35]
    # A lower step committed after a rollback: it and the newest complete survive.
    assert retention_victims(scan, committed=20, keep_last=1) == [5, 10, 30]


def test_delete_step_removes_manifest_first_and_the_directory(tmp_path):
    root = _root(tmp_path, complete=[1], incomplete=[])
    scan = scan_steps(root)
    delete_step(root, 1, scan.files[1])
    assert not (tmp_path / "step_00000001").exists()
    assert scan_steps(root).complete == []


def test_retention_imports_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import goodput_ckpt.manager.retention, goodput_ckpt.manager.step_layout, goodput_ckpt.manager.timeline\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_restore_removes_a_step_directory_left_empty_by_a_killed_deletion(tmp_path):
    """Retention cut short by SIGKILL between the last unlink and the rmdir leaves an empty
    step directory (issue 20): restore's clean-up removes it, and keeps every real step."""
    import torch

    from goodput_ckpt import CheckpointManager

    model = torch.nn.Linear(2, 2)
    with CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, model=model)
    (tmp_path / "run" / "step_00000000").mkdir()  # what the killed deletion left
    (tmp_path / "run" / "step_00000002" / "nested").mkdir(parents=True)
    with CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        assert mgr.restore(model=model) == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == ["step_00000001"]
