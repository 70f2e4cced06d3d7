"""Manifest version 3: file entries that live in a sibling location (format/references.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers.incremental import frozen_model, load_model, save_steps

from goodput_ckpt import CheckpointError, CorruptCheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME, REFERENCES_VERSION, parse_manifest, seal_manifest
from goodput_ckpt.format.references import base_problem
from goodput_ckpt.tools import verify_checkpoint


def _manifest(root, step):
    with open(os.path.join(root, f"step_{step:08d}", MANIFEST_NAME), "rb") as f:
        return f.read()


def _resealed(raw: bytes, edit) -> bytes:
    doc = json.loads(raw)
    doc.pop("digest")
    edit(doc)
    return seal_manifest(json.dumps(doc, separators=(",", ":")).encode())


def test_an_incremental_step_references_its_base_and_loads_bit_exactly(tmp_path):
    model = frozen_model()
    _, writers = save_steps(str(tmp_path), model, [1, 2, 3])
    full, inc = parse_manifest(_manifest(tmp_path, 1)), parse_manifest(_manifest(tmp_path, 3))
    assert full.version == 2 and full.bases() == set()  # a full save stays readable by version-2 readers
    assert inc.version == REFERENCES_VERSION and inc.bases() == {"step_00000001"}
    assert inc.referenced_bytes() > 0 and inc.written_bytes() == writers[2].bytes_written
    loaded = load_model(str(tmp_path / "step_00000003"))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("base", ["..", ".", "", "a/b", "/abs", "a\\b", "C:", "x" * 256, 7, None])
def test_a_base_that_is_not_one_plain_path_component_is_refused(tmp_path, base):
    save_steps(str(tmp_path), frozen_model(), [1, 2])
    raw = _manifest(tmp_path, 2)
    name = next(n for n, f in json.loads(raw)["files"].items() if "base" in f)

    def edit(doc):
        doc["files"][name]["base"] = base

    if base is None:
        parse_manifest(_resealed(raw, edit))  # null is absent: a file of the location itself
        return
    with pytest.raises(CorruptCheckpointError, match="'base'"):
        parse_manifest(_resealed(raw, edit))
    assert base_problem(base) is not None


def test_a_base_needs_version_3(tmp_path):
    save_steps(str(tmp_path), frozen_model(), [1, 2])

    def edit(doc):
        doc["version"] = 2

    with pytest.raises(CorruptCheckpointError, match="needs version 3"):
        parse_manifest(_resealed(_manifest(tmp_path, 2), edit))


def test_a_base_reached_through_a_symbolic_link_is_refused(tmp_path):
    root = tmp_path / "root"
    save_steps(str(root), frozen_model(), [1, 2])
    moved = tmp_path / "elsewhere"
    shutil.move(str(root / "step_00000001"), str(moved))
    os.symlink(moved, root / "step_00000001")
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_model(str(root / "step_00000002"))
    report = verify_checkpoint(str(root / "step_00000002"))
    assert not report.ok and any("symbolic link" in p.message for p in report.problems)


def test_verify_hashes_referenced_bytes_and_names_the_damage(tmp_path):
    save_steps(str(tmp_path), frozen_model(), [1, 2])
    ok = verify_checkpoint(str(tmp_path / "step_00000002"))
    assert ok.ok and ok.bytes_referenced > 0 and ok.bytes_hashed == ok.bytes_total
    base_dir = tmp_path / "step_00000001"
    data = next(p for p in base_dir.iterdir() if p.suffix == ".bin")
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    bad = verify_checkpoint(str(tmp_path / "step_00000002"))
    assert bad.status == "corrupt" and any(p.file == data.name for p in bad.problems)
    with pytest.raises(CorruptCheckpointError, match=data.name):
        load_model(str(tmp_path / "step_00000002"))


def test_a_missing_base_is_a_corrupt_checkpoint_naming_the_file(tmp_path):
    save_steps(str(tmp_path), frozen_model(), [1, 2])
    shutil.rmtree(tmp_path / "step_00000001")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load_model(str(tmp_path / "step_00000002"))
    assert verify_checkpoint(str(tmp_path / "step_00000002")).status == "corrupt"


def test_a_truncated_base_file_is_refused_by_the_load_and_reported_by_verify(tmp_path):
    """A base file cut short is a typed error naming it, from the load's size check before any
    data byte is read (engine/manifest_load.py), and a problem of ``verify``'s report."""
    save_steps(str(tmp_path), frozen_model(), [1, 2])
    data = next(p for p in (tmp_path / "step_00000001").iterdir() if p.suffix == ".bin")
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=data.name):
        load_model(str(tmp_path / "step_00000002"))
    report = verify_checkpoint(str(tmp_path / "step_00000002"))
    assert report.status == "corrupt" and any(p.file == data.name for p in report.problems)


def test_the_spec_reader_reads_a_referenced_tensor(tmp_path):
    """docs/format.md's example reader follows a `base` (and checks its chunk digests)."""
    import re
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    namespace: dict = {}
    exec(re.findall(r"```python\n(.*?)```", spec, flags=re.S)[-1], namespace)  # noqa: S102 - our own doc
    model = frozen_model()
    save_steps(str(tmp_path), model, [1, 2])
    got = namespace["read_tensor"](str(tmp_path / "step_00000002"), "model.0.weight")
    assert parse_manifest(_manifest(tmp_path, 2)).bases() == {"step_00000001"}
    assert (got == model[0].weight.numpy()).all()


def test_sealed_bases_reads_the_files_table_of_a_sealed_record_only(tmp_path):
    """``sealed_bases``: the bases of a sealed record of a known version; ``None`` for anything
    else, so that the caller reads the record in full (issue 40)."""
    from goodput_ckpt.format.references import sealed_bases

    save_steps(str(tmp_path), frozen_model(), [1, 2])
    raw = _manifest(tmp_path, 2)
    assert sealed_bases(raw) == parse_manifest(raw).bases() == {"step_00000001"}
    assert sealed_bases(_manifest(tmp_path, 1)) == frozenset()
    assert sealed_bases(raw[:-5]) is None  # torn
    assert sealed_bases(raw.replace(b"step_00000001", b"step_00000009", 1)) is None  # seal broken
    assert sealed_bases(_resealed(raw, lambda d: d.update(version=99))) is None
    assert sealed_bases(_resealed(raw, lambda d: d.update(version=2))) is None  # references need 3
    assert sealed_bases(_resealed(raw, lambda d: d.update(files=[]))) is None

    def hostile(doc):
        next(f for f in doc["files"].values() if "base" in f)["base"] = ".."

    assert sealed_bases(_resealed(raw, hostile)) is None
