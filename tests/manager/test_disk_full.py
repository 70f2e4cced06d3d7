"""What ``free_space_on_full`` deletes (manager/disk_full.py), on hand-made records: the same
reference rule as retention (manager/step_references.py), never plain step order."""

from __future__ import annotations

import logging

from helpers.records import record_referencing

from goodput_ckpt.manager.disk_full import free_oldest
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.storage import open_store


def _plant(root, step: int, bases: list[int], *, record: bool = True) -> None:
    """A step with one data file and, when ``record``, a commit record that references the data
    file of each step in ``bases``."""
    d = root / step_dir_name(step)
    d.mkdir(parents=True, exist_ok=True)
    (d / "data.bin").write_bytes(b"x")
    if record:
        (d / "manifest.json").write_bytes(record_referencing(bases))


def _deleted(caplog) -> list[int]:
    return [int(r.getMessage().split("step ")[1].split()[0]) for r in caplog.records if "deleted" in r.getMessage()]


def test_a_referencing_step_goes_before_its_base(tmp_path, caplog):
    """Step 1 lost its commit record (a base whose deletion was cut short) but step 2 still
    reads its data file: both go, step 2 first, so a kill between the two deletions never leaves
    a complete step 2 whose base is gone (before: ascending, step 1 first)."""
    _plant(tmp_path, 1, [], record=False)
    _plant(tmp_path, 2, [1])
    _plant(tmp_path, 3, [])
    with caplog.at_level(logging.INFO, logger="goodput_ckpt.retention"):
        assert free_oldest(open_store(str(tmp_path))) == [1, 2]
    assert _deleted(caplog) == [2, 1]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [step_dir_name(3)]


def test_an_incomplete_step_that_a_kept_step_references_stays(tmp_path):
    """An incomplete step is deleted only when no step that stays references it, as retention
    decides (before: every incomplete step went, and with it the base of the newest step)."""
    _plant(tmp_path, 1, [], record=False)
    _plant(tmp_path, 2, [1])
    _plant(tmp_path, 4, [], record=False)  # the failed save
    assert free_oldest(open_store(str(tmp_path))) == [4]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [step_dir_name(1), step_dir_name(2)]


def test_protected_steps_and_the_newest_stay(tmp_path):
    """A step a persist still reads stays, and so does what it references; the oldest complete
    step that nothing kept references goes."""
    _plant(tmp_path, 1, [])
    _plant(tmp_path, 2, [1])
    _plant(tmp_path, 3, [])
    _plant(tmp_path, 4, [])
    assert free_oldest(open_store(str(tmp_path)), protect=(2,)) == [3]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [step_dir_name(s) for s in (1, 2, 4)]
