"""The store interface's shared helpers: what an invalid commit record means, by store."""

from __future__ import annotations

import pytest

from goodput_ckpt import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from goodput_ckpt.storage.base import StoreTraits, parse_commit_record


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


def test_drop_done_continues_a_short_vectored_transfer():
    from goodput_ckpt.storage.base import drop_done

    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"h")]
    drop_done(views, 0)
    assert [bytes(v) for v in views] == [b"abc", b"defg", b"h"]
    drop_done(views, 4)  # all of the first view and one byte of the second
    assert [bytes(v) for v in views] == [b"efg", b"h"]
    drop_done(views, 3)
    assert [bytes(v) for v in views] == [b"h"]
    drop_done(views, 1)
    assert views == []
