"""Nothing outside a checkpoint location is read, written or deleted (hostile-inputs issue, item 1).

A location can hold symbolic links that someone else put there: a linked subdirectory, a linked
data file, a manifest that lists files through them. The local store refuses every path through a
link, and a save with ``overwrite=True`` deletes only the files it can prove belong to the old
checkpoint. Each test fails on the code before the fix: the victim file outside the location was
deleted, truncated or read.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME, seal_manifest
from goodput_ckpt.storage import LocalStore


def _save(path, value: float = 1.0) -> None:
    dcp.save({"w": torch.full((64,), value)}, storage_writer=CheckpointWriter(str(path), overwrite=True))


def _relist_through_link(ckpt, link_dir: str) -> str:
    """List the checkpoint's data file under the subdirectory ``link_dir`` in a resealed manifest
    (consistent sizes and hashes): the attacker's setup. Returns the new name."""
    doc = json.loads(_unsealed(ckpt))
    (old,) = doc["files"]
    new = f"{link_dir}/{old}"
    doc["files"] = {new: doc["files"][old]}
    for item in doc["items"].values():
        for ref in item.get("chunks", [item]):
            if ref.get("file") == old:
                ref["file"] = new
    (ckpt / MANIFEST_NAME).write_bytes(seal_manifest(json.dumps(doc).encode()))
    return new


def _unsealed(ckpt) -> str:
    from goodput_ckpt.format.manifest import parse_manifest

    m = parse_manifest((ckpt / MANIFEST_NAME).read_bytes(), location=str(ckpt))
    return m.to_json().decode()


def test_overwrite_never_deletes_through_a_linked_directory(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    _save(ckpt)
    outside.mkdir()
    (ckpt / "sub").symlink_to(outside, target_is_directory=True)
    name = _relist_through_link(ckpt, "sub")
    victim = outside / name.split("/", 1)[1]
    os.replace(ckpt / name.split("/", 1)[1], victim)  # the listed file, sizes and hashes right
    before = victim.read_bytes()
    with pytest.warns(UserWarning, match="symbolic link"):
        _save(ckpt, 2.0)
    assert victim.read_bytes() == before, "a file outside the checkpoint was deleted or changed"
    dest = {"w": torch.zeros(64)}
    dcp.load(dest, storage_reader=CheckpointReader(str(ckpt)))
    assert torch.equal(dest["w"], torch.full((64,), 2.0))


def test_overwrite_keeps_a_listed_file_of_another_size(tmp_path):
    """A file the old manifest lists but whose size differs is not provably the old checkpoint's."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt)
    (ckpt / "data").mkdir()
    name = _relist_through_link(ckpt, "data")  # a plain subdirectory here, no link
    (ckpt / name).write_bytes(b"someone else's data")
    with pytest.warns(UserWarning, match="not provably"):
        _save(ckpt, 2.0)
    assert (ckpt / name).read_bytes() == b"someone else's data"


def test_store_refuses_every_path_through_a_link(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "f.bin").write_bytes(b"precious")
    (root / "sub").symlink_to(outside, target_is_directory=True)
    (root / "file.bin").symlink_to(outside / "f.bin")
    store = LocalStore(str(root))
    for call in (
        lambda: store.delete("sub/f.bin"),
        lambda: store.delete("file.bin"),
        lambda: store.size("sub/f.bin"),
        lambda: store.size("file.bin"),
        lambda: store.read_small("sub/f.bin"),
        lambda: store.read_small("file.bin"),
        lambda: store.open_source("sub/f.bin"),
        lambda: store.open_source("file.bin"),
        lambda: store.open_sink("sub/f.bin"),
        lambda: store.put_commit_record("sub/f.bin", b"x", replace=True),
    ):
        with pytest.raises(CheckpointError):
            call()
    assert (outside / "f.bin").read_bytes() == b"precious"
    assert os.path.islink(root / "file.bin")  # refused, not removed
    assert store.list() == []  # links are not part of the location


def test_sink_replaces_a_hard_link_instead_of_truncating_it(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside.bin"
    root.mkdir()
    outside.write_bytes(b"precious")
    os.link(outside, root / "rank00000-00.0123456789ab.bin")
    sink = LocalStore(str(root)).open_sink("rank00000-00.0123456789ab.bin")
    sink.write_at(0, [b"new"])
    sink.close()
    assert outside.read_bytes() == b"precious"
    assert (root / "rank00000-00.0123456789ab.bin").read_bytes() == b"new"


def test_linked_data_file_is_not_loaded(tmp_path):
    """A data file replaced by a link to a file elsewhere is refused, not read (item 15)."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt)
    (name,) = json.loads(_unsealed(ckpt))["files"]
    os.replace(ckpt / name, tmp_path / "elsewhere.bin")
    (ckpt / name).symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(64)}, storage_reader=CheckpointReader(str(ckpt)))
    assert "symbolic link" in str(info.value)


def test_a_linked_root_is_the_directory_it_points_to(tmp_path):
    """The root itself may be a link (a checkpoint directory on another disk): it is resolved once."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    _save(tmp_path / "alias")
    assert (real / MANIFEST_NAME).exists()
    dest = {"w": torch.zeros(64)}
    dcp.load(dest, storage_reader=CheckpointReader(str(tmp_path / "alias")))
    assert torch.equal(dest["w"], torch.ones(64))
