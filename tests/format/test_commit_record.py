"""The commit record, read in one place: what a record that fails to validate means, by store;
the tagged result every reader acts on; which keys own a byte range; chunk verification."""

from __future__ import annotations

import json

import blake3
import pytest

from goodput_ckpt import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from goodput_ckpt.errors import CheckpointNotFoundError
from goodput_ckpt.format.commit_record import (
    COMMITTED,
    CORRUPT,
    MISSING,
    TORN,
    UNSUPPORTED,
    KeyIndex,
    bad_chunks,
    file_problems,
    parse_commit_record,
    read_commit_record,
)
from goodput_ckpt.format.manifest import MANIFEST_NAME, FileEntry, Manifest, ObjectEntry, parse_manifest
from goodput_ckpt.storage import open_store
from goodput_ckpt.storage.base import StoreTraits


class _Store:
    uri = "somewhere/ckpt"
    traits = StoreTraits(kind="local", random_writes=True)


class _InPlace(_Store):
    traits = StoreTraits(kind="volume", random_writes=False, atomic_commit_record=False)


def _bad(data: bytes):
    raise CorruptCheckpointError(f"record {data!r} is invalid", path="somewhere/ckpt/manifest.json", byte_range=(0, 4))


def test_an_invalid_record_is_corrupt_where_commits_are_atomic_and_incomplete_elsewhere():
    assert parse_commit_record(_Store(), "manifest.json", b"ok", bytes.decode) == "ok"
    with pytest.raises(CorruptCheckpointError, match="invalid") as corrupt:
        parse_commit_record(_Store(), "manifest.json", b"{", _bad)  # the default: atomic
    assert not isinstance(corrupt.value, IncompleteCheckpointError)
    with pytest.raises(IncompleteCheckpointError, match="mounted volume .*invalid.*interrupted") as info:
        parse_commit_record(_InPlace(), "manifest.json", b"{", _bad)
    err = info.value
    assert err.path == "somewhere/ckpt/manifest.json" and err.byte_range == (0, 4)
    assert isinstance(err.__cause__, CorruptCheckpointError)

    def unknown_version(data: bytes):
        raise CheckpointError("version 9", version=9)

    for store in (_Store(), _InPlace()):  # not a question of atomicity: passed through
        with pytest.raises(CheckpointError, match="version 9") as other:
            parse_commit_record(store, "manifest.json", b"{}", unknown_version)
        assert type(other.value) is CheckpointError


CHUNK = 4096


def _checkpoint(tmp_path, data: bytes = bytes(range(256)) * 40) -> tuple[str, Manifest]:
    """A one-file checkpoint of ``data`` with one object item over all of it."""
    loc = tmp_path / "ckpt"
    loc.mkdir()
    (loc / "f.bin").write_bytes(data)
    digests = tuple(blake3.blake3(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK))
    m = Manifest(
        version=1,
        library_version="t",
        torch_version="t",
        created_at="t",
        world_size=1,
        chunk_size=CHUNK,
        files={"f.bin": FileEntry("f.bin", len(data), digests)},
        items={"obj": ObjectEntry("obj", "torch.save", "f.bin", 0, len(data))},
    )
    (loc / MANIFEST_NAME).write_bytes(m.to_json())
    return str(loc), m


def test_every_status(tmp_path):
    empty = read_commit_record(open_store(str(tmp_path / "nothing")))
    assert empty.status == MISSING and empty.file_count == 0
    with pytest.raises(CheckpointNotFoundError):
        empty.manifest_or_raise()

    loc, m = _checkpoint(tmp_path)
    record = read_commit_record(open_store(loc))
    assert record.status == COMMITTED and record.manifest == m and record.manifest_or_raise() == m

    raw = (tmp_path / "ckpt" / MANIFEST_NAME).read_bytes()
    (tmp_path / "ckpt" / MANIFEST_NAME).write_bytes(raw[:-10])
    record = read_commit_record(open_store(loc))
    assert record.status == CORRUPT and isinstance(record.error, CorruptCheckpointError)

    doc = json.loads(raw)
    doc["version"] = 7
    (tmp_path / "ckpt" / MANIFEST_NAME).write_bytes(json.dumps(doc).encode())
    record = read_commit_record(open_store(loc))
    assert record.status == UNSUPPORTED and record.error.version == 7

    (tmp_path / "ckpt" / MANIFEST_NAME).unlink()
    record = read_commit_record(open_store(loc))
    assert record.status == MISSING and record.file_count == 1
    assert "holds 1 file(s) but no manifest.json" in record.message
    with pytest.raises(IncompleteCheckpointError, match="holds 1 file"):
        record.manifest_or_raise()


def test_a_record_torn_on_a_volume(tmp_path):
    loc, _ = _checkpoint(tmp_path)
    raw = (tmp_path / "ckpt" / MANIFEST_NAME).read_bytes()
    (tmp_path / "ckpt" / MANIFEST_NAME).write_bytes(raw[: len(raw) // 2])
    record = read_commit_record(open_store(loc, {"volume": True}))
    assert record.status == TORN and "mounted volume" in record.message


def test_a_listing_without_the_record_needs_no_read(tmp_path):
    loc, _ = _checkpoint(tmp_path)
    record = read_commit_record(open_store(loc), listing=["f.bin"])  # listed before the commit
    assert record.status == MISSING and record.file_count == 1


def test_file_problems_name_the_keys(tmp_path):
    loc, m = _checkpoint(tmp_path)
    assert list(file_problems(open_store(loc), m)) == []
    data = (tmp_path / "ckpt" / "f.bin").read_bytes()
    (tmp_path / "ckpt" / "f.bin").write_bytes(data[:5000])
    (p,) = file_problems(open_store(loc), m)
    assert p.kind == "size" and p.byte_range == (5000, len(data)) and p.keys == ("obj",)
    err = p.error(open_store(loc).uri)
    assert isinstance(err, CorruptCheckpointError) and "truncated" in str(err) and err.key == "obj"
    (tmp_path / "ckpt" / "f.bin").unlink()
    (p,) = file_problems(open_store(loc), m)
    assert p.kind == "missing" and "is missing" in p.message


def test_key_index_finds_every_overlapping_key():
    m = parse_manifest(open(__file__.replace("test_commit_record.py", "hostile/valid.json"), "rb").read())
    index = KeyIndex(m)
    f0 = "rank00000-00.0123456789ab.bin"
    assert index.keys(f0, 0, 1) == ["w"]
    assert index.keys(f0, 8000, 8200) == ["w", "step"]
    assert index.keys(f0, 8192, 8193) == ["step"]
    assert index.keys(f0, 8256, 9000) == [] and index.keys("other", 0, 10) == []


def test_bad_chunks_across_buffers_of_any_size():
    data = bytearray(bytes(range(256)) * 40)  # 10240 bytes: chunks of 4096, 4096, 2048
    entry = FileEntry(
        "f", len(data), tuple(blake3.blake3(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK))
    )
    view = memoryview(data)
    pieces = [view[a:b] for a, b in ((0, 100), (100, 5000), (5000, 5000), (5000, len(data)))]
    assert bad_chunks(entry, CHUNK, 0, pieces) == []
    data[4096] ^= 1
    assert bad_chunks(entry, CHUNK, 0, [view]) == [1]
    assert bad_chunks(entry, CHUNK, 8192, [view[8192:]]) == []
    with pytest.raises(ValueError, match="inside chunk"):
        bad_chunks(entry, CHUNK, 0, [view[:100]])
