"""Files of failed saves in a committed step directory (goodput_ckpt/manager/step_leftovers.py), and
the manager's step writers without the pre-save listing on S3 (``known_new``), here on local disk
and on a volume, where the pre-save check is a directory read and keeps its semantics. The S3
side (request counts, a failed save's files, a record committed elsewhere):
``tests/storage/test_s3_save_requests.py``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointExistsError, CheckpointManager, CheckpointWriter
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.manager.retention import apply_retention, note_committed
from goodput_ckpt.manager.step_leftovers import leftover_files, remove_leftovers
from goodput_ckpt.storage import open_store

OURS = "rank00000-00.aaaaaaaaaaaa.bin"
DEAD = "rank00001-00.0123456789ab.bin"  # a failed save's data file
TMP = ".manifest.json.tmp-12ab"  # a failed commit's temporary record


def _record(*files: str) -> bytes:
    return json.dumps({"format": "goodput-ckpt", "version": 3, "files": {f: {} for f in files}}).encode()


def test_leftovers_are_the_save_files_the_record_does_not_list():
    names = [MANIFEST_NAME, OURS, DEAD, TMP, "notes.txt", "sub/rank00002-00.0123456789ab.bin"]
    assert leftover_files(names, _record(OURS)) == [DEAD, TMP]
    assert leftover_files(names, _record(OURS, DEAD)) == [TMP]
    # A record that cannot be read, or is not of this format: nothing is deleted.
    assert leftover_files(names, b"{garbled") == []
    assert leftover_files(names, json.dumps({"format": "other", "files": {}}).encode()) == []


def test_one_saves_files_alone_are_judged_without_parsing_the_record(monkeypatch):
    """The common case (no failed save left anything): the record is not parsed per commit."""
    from goodput_ckpt.manager import step_leftovers

    parsed = []
    real = step_leftovers.committed_names
    monkeypatch.setattr(step_leftovers, "committed_names", lambda r: parsed.append(r) or real(r))
    same = "rank00001-00.aaaaaaaaaaaa.bin"  # another rank's file of the committed save
    assert leftover_files([MANIFEST_NAME, OURS, same, "notes.txt"], _record(OURS, same)) == []
    assert parsed == []
    assert leftover_files([MANIFEST_NAME, OURS, DEAD], _record(OURS)) == [DEAD]  # two tokens: parsed
    assert leftover_files([MANIFEST_NAME, OURS, TMP], _record(OURS)) == [TMP]  # a temporary record: parsed
    assert len(parsed) == 2


def test_remove_leftovers_deletes_only_inside_complete_steps(tmp_path):
    for step in (3, 4):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        for name in (OURS, DEAD, "notes.txt"):
            (d / name).write_bytes(b"x")
    (tmp_path / "step_00000003" / MANIFEST_NAME).write_bytes(_record(OURS))
    root = open_store(str(tmp_path))
    files = {3: sorted(p.name for p in (tmp_path / "step_00000003").iterdir())}
    files[4] = sorted(p.name for p in (tmp_path / "step_00000004").iterdir())  # no record: incomplete
    remove_leftovers(root, files, {3: _record(OURS), 4: _record(OURS)})
    assert sorted(p.name for p in (tmp_path / "step_00000003").iterdir()) == sorted([MANIFEST_NAME, OURS, "notes.txt"])
    assert (tmp_path / "step_00000004" / DEAD).exists()  # not judged: no record in the listing


def test_retention_cleans_every_step_noted_since_its_last_run(tmp_path):
    """Runs waiting behind a running one merge into one for the newest commit
    (background_retention.py): that run cleans the steps of the merged commits too. A step
    committed after the run picked its commit is left to its own run."""
    root = open_store(str(tmp_path))
    for step in (6, 7, 8):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / OURS).write_bytes(b"x")
        (d / DEAD).write_bytes(b"x")
        (d / MANIFEST_NAME).write_bytes(_record(OURS))
        note_committed(f"{root.uri}/step_{step:08d}", _record(OURS))
    apply_retention(root, committed=7, keep_last=None)
    clean = sorted([MANIFEST_NAME, OURS])
    assert [sorted(p.name for p in (tmp_path / f"step_{s:08d}").iterdir()) == clean for s in (6, 7, 8)] == [
        True,
        True,
        False,
    ]
    apply_retention(root, committed=8, keep_last=None)
    assert sorted(p.name for p in (tmp_path / "step_00000008").iterdir()) == clean


def test_known_new_excludes_overwrite(tmp_path):
    with pytest.raises(ValueError, match="known_new and overwrite"):
        CheckpointWriter(tmp_path / "x", known_new=True, overwrite=True)


@pytest.mark.parametrize("kind", ["local", "volume"])
def test_known_new_keeps_the_check_before_the_save_on_local_disk_and_volumes(tmp_path, kind):
    """Elsewhere than S3 the check is a directory read, not a request: a committed record is
    still refused before any rank writes, and failed saves' files are still removed by the save."""
    options = {"volume": kind == "volume"}
    loc = tmp_path / "loc"
    dcp.save({"w": torch.ones(8)}, storage_writer=CheckpointWriter(loc, **options), no_dist=True)
    before = sorted(p.name for p in loc.iterdir())
    with pytest.raises(CheckpointException, match="already holds a committed checkpoint"):  # DCP's wrapper
        dcp.save({"w": torch.zeros(8)}, storage_writer=CheckpointWriter(loc, known_new=True, **options), no_dist=True)
    assert sorted(p.name for p in loc.iterdir()) == before
    (loc / MANIFEST_NAME).unlink()  # now the files of a failed save
    dcp.save({"w": torch.zeros(8)}, storage_writer=CheckpointWriter(loc, known_new=True, **options), no_dist=True)
    listed = set(json.loads((loc / MANIFEST_NAME).read_bytes())["files"])
    assert {p.name for p in loc.iterdir()} == listed | {MANIFEST_NAME}


@pytest.mark.parametrize("kind", ["local", "volume"])
def test_a_manager_resaving_a_failed_step_on_local_disk_and_volumes(tmp_path, kind):
    """The manager's side of the same: the step of a save that died before its commit is saved
    again, and only the new save's files are left; a record committed elsewhere after the
    manager's listing is refused, and stays as it was."""
    options = {"volume": kind == "volume"}
    root = tmp_path / "root"
    dead = root / "step_00000003"
    dcp.save({"w": torch.ones(8)}, storage_writer=CheckpointWriter(dead, **options), no_dist=True)
    (dead / MANIFEST_NAME).unlink()
    left = {p.name for p in dead.iterdir()}
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(root, keep_last=2, async_save=False, timeline=False, **options) as mgr:
        mgr.save(3, model=model)
        listed = set(json.loads((dead / MANIFEST_NAME).read_bytes())["files"])
        assert {p.name for p in dead.iterdir()} == listed | {MANIFEST_NAME} and not listed & left
        other = root / "step_00000005"
        dcp.save({"w": torch.ones(8)}, storage_writer=CheckpointWriter(other, **options), no_dist=True)
        theirs = {p.name: p.read_bytes() for p in other.iterdir()}
        with pytest.raises(CheckpointExistsError):
            mgr.save(5, model=model)
        assert {p.name: p.read_bytes() for p in other.iterdir()} == theirs
