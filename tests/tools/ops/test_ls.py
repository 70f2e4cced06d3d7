"""list_checkpoints: steps under a manager root, complete / incomplete / corrupt."""

from __future__ import annotations

import pytest
import torch
from helpers.samples import copy_ckpt, damaged_manifests, flip_byte, item_range

from goodput_ckpt import CheckpointNotFoundError
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.tools.ops.ls import list_checkpoints


@pytest.fixture
def root(sample_ckpt, tmp_path):
    root = tmp_path / "run"
    src = sample_ckpt[0]
    copy_ckpt(src, root / "step_00000100")
    incomplete = copy_ckpt(src, root / "step_00000200")
    (incomplete / MANIFEST_NAME).unlink()
    corrupt = copy_ckpt(src, root / "step_00000300")
    f, off, _ = item_range(corrupt, "model.embed.weight")
    flip_byte(corrupt, f, off)
    garbled = copy_ckpt(src, root / "step_00000400")
    (garbled / MANIFEST_NAME).write_text("{")
    copy_ckpt(src, root / "not-a-step")  # ignored
    copy_ckpt(src, root / "step_1")  # a hand-written step_N name: listed too (issue 20)
    return root


def test_statuses_without_and_with_verify(root):
    r = list_checkpoints(str(root))
    assert [(c.step, c.status) for c in r.checkpoints] == [
        (1, "complete"),
        (100, "complete"),
        (200, "incomplete"),
        (300, "complete"),
        (400, "corrupt"),
    ]
    assert r.checkpoints[0].name == "step_1"
    assert r.latest_complete == 300 and not r.verified
    r.checkpoints.pop(0)
    done = r.checkpoints[0]
    assert done.name == "step_00000100" and done.uri.endswith("/step_00000100")
    assert done.created_at and done.files == 1 and done.bytes > 0
    assert r.checkpoints[1].bytes > 0 and r.checkpoints[1].created_at is None
    v = list_checkpoints(str(root), verify=True)
    assert [c.status for c in v.checkpoints][1:] == ["complete", "incomplete", "corrupt", "corrupt"]
    assert v.latest_complete == 100
    assert any("checksum mismatch" in p for p in v.checkpoints[3].problems)
    quick = list_checkpoints(str(root), verify=True, quick=True)
    assert quick.checkpoints[3].status == "complete"  # a flipped byte needs hashing


def test_invalid_manifest_is_corrupt_on_disk_and_incomplete_on_a_volume(sample_ckpt, tmp_path):
    root = tmp_path / "run"
    good = (sample_ckpt[0] / MANIFEST_NAME).read_bytes()
    copy_ckpt(sample_ckpt[0], root / "step_00000100")
    for i, data in enumerate(damaged_manifests(good).values()):
        (copy_ckpt(sample_ckpt[0], root / f"step_0000020{i}") / MANIFEST_NAME).write_bytes(data)
    on_disk = list_checkpoints(str(root))
    assert [c.status for c in on_disk.checkpoints] == ["complete", "corrupt", "corrupt", "corrupt"]
    on_volume = list_checkpoints(str(root), volume=True, verify=True)
    assert [c.status for c in on_volume.checkpoints] == ["complete", "incomplete", "incomplete", "incomplete"]
    assert all("mounted volume" in c.problems[0] for c in on_volume.checkpoints[1:])
    assert on_volume.latest_complete == 100


def test_missing_root_and_a_checkpoint_as_root(sample_ckpt, tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        list_checkpoints(str(tmp_path / "nope"))
    with pytest.raises(CheckpointNotFoundError, match="is a checkpoint"):
        list_checkpoints(str(sample_ckpt[0]))


def test_lists_what_the_manager_writes(tmp_path):
    from goodput_ckpt import CheckpointManager

    model = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(str(tmp_path / "run"), async_save=False)
    try:
        mgr.save(10, model=model)
        mgr.save(20, model=model)
    finally:
        mgr.close()
    r = list_checkpoints(str(tmp_path / "run"), verify=True)
    assert [(c.step, c.status) for c in r.checkpoints] == [(10, "complete"), (20, "complete")]
    assert r.latest_complete == mgr.latest_step() == 20


def test_lists_the_readme_quick_start_layout(tmp_path):
    """The README's quick start saves ``ckpt/step_100`` with CheckpointWriter (issue 20)."""
    import torch.distributed.checkpoint as dcp

    from goodput_ckpt import CheckpointWriter

    dcp.save({"w": torch.ones(3)}, storage_writer=CheckpointWriter(str(tmp_path / "ckpt" / "step_100")), no_dist=True)
    r = list_checkpoints(str(tmp_path / "ckpt"))
    assert [(c.step, c.name, c.status) for c in r.checkpoints] == [(100, "step_100", "complete")]


def test_a_root_without_checkpoints_is_not_found_like_a_missing_one(sample_ckpt, tmp_path):
    """Both exit 2 from the CLI (docs/tools.md: no checkpoint at the location)."""
    from goodput_ckpt.cli import EXIT_USAGE, main

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="no step_N directories"):
        list_checkpoints(str(tmp_path / "notes"))
    copy_ckpt(sample_ckpt[0], tmp_path / "odd" / "best")
    with pytest.raises(CheckpointNotFoundError, match="other directories: best"):
        list_checkpoints(str(tmp_path / "odd"))
    assert main(["ls", str(tmp_path / "nope")]) == EXIT_USAGE
    assert main(["ls", str(tmp_path / "notes")]) == EXIT_USAGE
