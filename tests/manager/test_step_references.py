"""Which steps kept steps reference (manager/step_references.py), on hand-made records."""

from __future__ import annotations

import os

from helpers.records import record_referencing

from goodput_ckpt.manager.retention import scan_steps, spare_referenced
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.manager.step_references import protected_steps
from goodput_ckpt.storage import open_store


def _plant(root, step: int, bases: list[int]) -> None:
    d = root / step_dir_name(step)
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_bytes(record_referencing(bases))


def test_references_are_followed_through_kept_and_protected_steps(tmp_path):
    for step, bases in {1: [], 2: [], 3: [1], 4: [2, 3], 5: [4]}.items():
        _plant(tmp_path, step, bases)
    store = open_store(str(tmp_path))
    scan = scan_steps(store)
    assert protected_steps(store, scan.files, [5]) == {4, 3, 2, 1}
    assert protected_steps(store, scan.files, [3]) == {1}
    assert spare_referenced(store, scan, [1, 2, 3]) == []  # 4 and 5 stay and reach all three
    assert spare_referenced(store, scan, [1, 2, 3, 4]) == []  # 5 references 4, which references 2 and 3
    assert spare_referenced(store, scan, [1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5]


def test_a_base_outside_the_step_layout_protects_nothing(tmp_path):
    _plant(tmp_path, 1, [])
    d = tmp_path / step_dir_name(2)
    d.mkdir()
    rec = record_referencing([1]).replace(step_dir_name(1).encode(), b"elsewhere", 1)
    from goodput_ckpt.format.manifest import seal_manifest

    body = rec[: rec.rindex(b',"digest":"')] + b"}"
    (d / "manifest.json").write_bytes(seal_manifest(body))
    store = open_store(str(tmp_path))
    assert protected_steps(store, scan_steps(store).files, [2]) == set()


def test_the_step_just_committed_is_read_afresh(tmp_path):
    """An overwrite of a step may change its references: the cache is bypassed for ``fresh``."""
    _plant(tmp_path, 1, [])
    _plant(tmp_path, 2, [])
    store = open_store(str(tmp_path))
    files = scan_steps(store).files
    assert protected_steps(store, files, [2]) == set()
    os.remove(tmp_path / step_dir_name(2) / "manifest.json")
    _plant(tmp_path, 2, [1])
    assert protected_steps(store, files, [2]) == set()  # remembered
    assert protected_steps(store, files, [2], fresh=[2]) == {1}


def _reseal(raw: bytes, edit) -> bytes:
    import json

    from goodput_ckpt.format.manifest import seal_manifest

    doc = json.loads(raw)
    doc.pop("digest")
    edit(doc)
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())


def test_sealed_records_are_read_for_their_bases_only(tmp_path):
    """Retention reads a sealed record's ``files`` table, not every tensor entry (issue 40: a full
    parse of each kept step made a restore's clean-up of an incremental root ~10% slower): a
    record sealed by its writer names its bases even where another part would not validate,
    while an unsealed, damaged or hostile one is read in full and protects every older step."""
    for step in (1, 2):
        _plant(tmp_path, step, [])
    sealed = _reseal(record_referencing([1]), lambda doc: doc.update(items={"k": {"kind": "nonsense"}}))
    d = tmp_path / step_dir_name(3)
    d.mkdir()
    (d / "manifest.json").write_bytes(sealed)
    store = open_store(str(tmp_path))
    assert protected_steps(store, scan_steps(store).files, [3], fresh=[3]) == {1}  # not 2
    (d / "manifest.json").write_bytes(sealed.replace(b'"f1.bin"', b'"f9.bin"', 1))  # seal broken
    assert protected_steps(store, scan_steps(store).files, [3], fresh=[3]) == {1, 2}
    hostile = _reseal(record_referencing([1]), lambda doc: doc["files"]["f1.bin"].update(base="../step_00000002"))
    (d / "manifest.json").write_bytes(hostile)
    assert protected_steps(store, scan_steps(store).files, [3], fresh=[3]) == {1, 2}


def test_retention_deletes_a_referencing_step_before_its_base(tmp_path, caplog):
    """Both beyond ``keep_last``, step 2 (which references 1) goes before step 1: a kill between
    the two deletions leaves step 1 with nothing referencing it, never a complete step 2 whose
    base is gone (issue 40, found by the SIGKILL trials with references)."""
    import logging

    from goodput_ckpt.manager.retention import apply_retention

    for step, bases in {1: [], 2: [1], 3: [], 4: [3]}.items():
        _plant(tmp_path, step, bases)
    with caplog.at_level(logging.INFO, logger="goodput_ckpt.retention"):
        apply_retention(open_store(str(tmp_path)), committed=4, keep_last=2)
    deleted = [int(r.getMessage().split("step ")[1].split()[0]) for r in caplog.records if "deleted" in r.getMessage()]
    assert deleted == [2, 1], deleted
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [step_dir_name(3), step_dir_name(4)]


def test_a_base_with_a_larger_step_number_goes_after_its_referrers(tmp_path):
    """A job rolled back saves steps 3 and 4 referencing step 10, its last save before the
    rollback: all three beyond ``keep_last``, 4 and 3 go before 10 (numbers would say 10 first)."""
    from goodput_ckpt.manager.retention import deletion_order

    for step, bases in {10: [], 3: [10], 4: [10], 20: [], 21: [20]}.items():
        _plant(tmp_path, step, bases)
    store = open_store(str(tmp_path))
    files = scan_steps(store).files
    assert deletion_order(store, files, [3, 4, 10]) == [4, 3, 10]
    assert deletion_order(store, files, [10, 20, 21]) == [21, 20, 10]  # no reference among them: newest first
    assert deletion_order(store, files, [10]) == [10]


def test_a_kept_step_with_a_larger_base_keeps_it(tmp_path):
    """Step 6 (just committed, kept) references step 20, which ``keep_last`` alone would delete."""
    for step, bases in {5: [], 6: [20], 20: [], 21: [], 22: []}.items():
        _plant(tmp_path, step, bases)
    store = open_store(str(tmp_path))
    scan = scan_steps(store)
    assert spare_referenced(store, scan, [5, 20], fresh=[6]) == [5]


def test_a_damaged_kept_step_protects_later_steps_too(tmp_path):
    """A kept step whose references cannot be known may reference a later step (a rollback):
    every other step stays, not only the older ones."""
    for step, bases in {5: [], 6: [], 20: [], 21: [], 22: []}.items():
        _plant(tmp_path, step, bases)
    (tmp_path / step_dir_name(6) / "manifest.json").write_bytes(b"{ not a record")
    store = open_store(str(tmp_path))
    scan = scan_steps(store)
    assert spare_referenced(store, scan, [5, 20], fresh=[6]) == []
