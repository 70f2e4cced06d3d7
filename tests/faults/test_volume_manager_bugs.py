"""CheckpointManager on mounted volumes: two bugs the reliability suite found, now fixed
(a torn commit record counted as complete; the default timeline appended on a volume).

A volume is simulated with ``volume=True`` on a local directory (the same store and the same
rules as on a FUSE mount), so these run without FUSE; test_crash_trials.py hits the first one on
a real rclone mount (its ``known_bug_torn_volume_record`` count).
"""

from __future__ import annotations

import shutil

from crash_worker import TrialModel

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.tools import list_checkpoints, verify_checkpoint


def _torn_step(tmp_path):
    """A root with step 1 committed and step 2 as a save killed while writing its manifest on
    a volume leaves it: every data file, and an empty ``manifest.json`` (the volume store writes
    the record in place under its final name; a FUSE mount uploads what it had when the
    writer dies)."""
    root = tmp_path / "root"
    model = TrialModel(64)
    model.fill(1)
    with CheckpointManager(root, volume=True, async_save=False, timeline=False) as mgr:
        mgr.save(1, model=model)
    step1, step2 = root / "step_00000001", root / "step_00000002"
    shutil.copytree(step1, step2)
    (step2 / MANIFEST_NAME).write_bytes(b"")
    return root, step2


def test_a_torn_commit_record_on_a_volume_is_incomplete_to_the_manager(tmp_path):
    root, step2 = _torn_step(tmp_path)
    # The reader and the tools already call it incomplete ...
    assert verify_checkpoint(str(step2), volume=True).status == "incomplete"
    assert [(c.step, c.status) for c in list_checkpoints(str(root), volume=True).checkpoints] == [
        (1, "complete"),
        (2, "incomplete"),
    ]
    # ... the manager must agree, and resume from step 1.
    mgr = CheckpointManager(root, volume=True, timeline=False)
    try:
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        model = TrialModel(64)
        assert mgr.restore(model=model) == 1 and model.holds(1)
    finally:
        mgr.close()


def test_default_timeline_of_a_volume_root_stays_in_memory(tmp_path):
    mgr = CheckpointManager(tmp_path / "root", volume=True)
    try:
        assert mgr.timeline_path is None
    finally:
        mgr.close()
