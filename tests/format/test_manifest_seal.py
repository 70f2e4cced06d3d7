"""The manifest's own digest: any edit of a committed manifest is detected."""

from __future__ import annotations

import json

import blake3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointError, CheckpointReader, CheckpointWriter, CorruptCheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest, seal_manifest


@pytest.fixture
def saved(tmp_path):
    dcp.save({"w": torch.randn(64, 8), "step": 3}, storage_writer=CheckpointWriter(tmp_path))
    return tmp_path


def test_sealed_manifest_ends_with_its_digest(saved):
    raw = (saved / MANIFEST_NAME).read_bytes()
    doc = json.loads(raw)
    assert list(doc)[-1] == "digest" and len(doc["digest"]) == 64
    parse_manifest(raw)


def test_consistent_edit_is_refused(saved):
    """float32 -> int32 keeps every size and range valid; only the digest catches it."""
    path = saved / MANIFEST_NAME
    raw = path.read_bytes()
    assert b'"dtype":"float32"' in raw
    path.write_bytes(raw.replace(b'"dtype":"float32"', b'"dtype":"int32"'))
    with pytest.raises(CorruptCheckpointError, match="fails its own checksum"):
        CheckpointReader(saved).read_metadata()


def test_missing_or_moved_digest_is_refused(saved):
    path = saved / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    digest = doc.pop("digest")
    path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="does not end with its digest"):
        CheckpointReader(saved).read_metadata()
    moved = {"digest": digest, **doc}
    path.write_bytes(json.dumps(moved, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="digest"):
        CheckpointReader(saved).read_metadata()


def test_resealed_hostile_edit_still_validated():
    """The digest is integrity, not authenticity: a resealed manifest is still fully validated."""
    raw = seal_manifest(
        b'{"format":"goodput-ckpt","version":1,"hash":{"algorithm":"blake3","chunk_size":4096},'
        b'"files":{"../x":{"size":0,"chunks":[]}},"items":{},"world_size":1}'
    )
    with pytest.raises(CorruptCheckpointError, match="unsafe file name"):
        parse_manifest(raw)


def test_seal_rejects_non_objects():
    for bad in (b"[]", b"{}", b"", b"1"):
        with pytest.raises(ValueError):
            seal_manifest(bad)


def test_damaged_version_digit_is_damage_not_a_newer_format(saved):
    """A flipped bit in ``"version":2`` fails the seal: corrupt, with the byte range, not
    "upgrade goodput-ckpt"."""
    path = saved / MANIFEST_NAME
    raw = path.read_bytes()
    assert raw.count(b'"version":2,') == 1
    path.write_bytes(raw.replace(b'"version":2,', b'"version":6,'))  # '2' ^ 0x04
    with pytest.raises(CorruptCheckpointError, match="claims format version 6 but fails its own checksum") as info:
        CheckpointReader(saved).read_metadata()
    assert info.value.byte_range[0] == 0 and info.value.version is None


@pytest.mark.parametrize("sealed", [True, False])
def test_newer_version_is_named_whether_or_not_sealed_like_v1(sealed):
    """A manifest written by a later version is refused by version, never called corrupt: sealed
    the v1 way (valid digest) or in a way this reader does not know (no digest member)."""
    body = b'{"format":"goodput-ckpt","version":4,"items":{}}'
    raw = seal_manifest(body) if sealed else body
    with pytest.raises(CheckpointError, match="reads versions 1, 2, 3") as info:
        parse_manifest(raw)
    assert not isinstance(info.value, CorruptCheckpointError) and info.value.version == 4


@pytest.mark.parametrize("body", [b'{"a":1}', b'{"a":[1,2]}  \n', b'{"k":"' + b"ab" * 50_000 + b'"}'])
def test_seal_is_the_blake3_of_everything_before_the_digest_member(body):
    head = body.rstrip()[:-1]
    assert seal_manifest(body) == head + b',"digest":"' + blake3.blake3(head).hexdigest().encode() + b'"}'


def test_seal_of_names_a_record_by_its_digest(saved):
    """``seal_of`` reads the recorded digest (what tells two copies of a record apart), and the
    committed record reports it; an unsealed body has none."""
    from goodput_ckpt.format.commit_record import COMMITTED, read_commit_record
    from goodput_ckpt.format.seal import seal_of
    from goodput_ckpt.storage import open_store

    raw = (saved / MANIFEST_NAME).read_bytes()
    assert seal_of(raw) == json.loads(raw)["digest"]
    assert seal_of(seal_manifest(b'{"a":1}')) == blake3.blake3(b'{"a":1').hexdigest()
    assert seal_of(b'{"a":1}') is None
    rec = read_commit_record(open_store(str(saved), {}))
    assert rec.status == COMMITTED and rec.digest == json.loads(raw)["digest"]
