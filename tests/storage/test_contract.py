"""The store contract, one test per event, over every backend: the same event raises the same error
type on local disk, a mounted volume (real FUSE mounts: strict rclone, permissive weed mount), S3
(moto) and fsspec (``memory://``), and each store declares what it is in ``store.traits``."""

from __future__ import annotations

import itertools

import pytest

from goodput_ckpt import CheckpointError, CheckpointExistsError, IncompleteCheckpointError
from goodput_ckpt.errors import FileTooLargeError
from goodput_ckpt.storage import BackgroundCommit, StaleUploads, Store, StoreTraits, open_store

_ids = itertools.count()
MiB = 1 << 20


@pytest.fixture(params=["local", "volume-rclone", "volume-weed", "s3", "fsspec"])
def store(request, tmp_path) -> Store:
    """A fresh, prepared location on each backend."""
    kind = request.param
    if kind == "local":
        s = open_store(tmp_path / "ckpt")
    elif kind.startswith("volume-"):
        s = open_store(request.getfixturevalue(f"{kind[len('volume-') :]}_volume").fresh(), {"volume": True})
    elif kind == "s3":
        moto = request.getfixturevalue("moto")
        s = open_store(moto.uri("ckpt"), moto.options(stale_upload_age=None))
    else:
        s = open_store(f"memory://goodput-contract-{next(_ids)}/ckpt")
    s.prepare()
    return s


def _sink(store: Store, name: str):
    # S3 takes parts of at least 5 MiB; the others ignore the part size.
    return store.open_sink(name, part_size=max(store.traits.min_part_size, 1))


def _put(store: Store, name: str, data: bytes) -> None:
    sink = _sink(store, name)
    sink.write_at(0, [data])
    sink.close()


def test_traits_are_declared(store):
    t = store.traits
    assert isinstance(t, StoreTraits)
    with pytest.raises(AttributeError):
        t.random_writes = not t.random_writes  # type: ignore[misc]  # frozen
    expected = {
        "local": dict(random_writes=True, atomic_commit_record=True, can_append=True, costly_requests=False),
        "volume": dict(random_writes=False, atomic_commit_record=False, can_append=False, sequential_reads=True),
        "s3": dict(random_writes=True, atomic_commit_record=True, costly_requests=True, min_part_size=5 * MiB),
        "fsspec": dict(random_writes=False, atomic_commit_record=True, costly_requests=True),
    }[t.kind]
    assert {k: getattr(t, k) for k in expected} == expected
    assert (t.local_path is not None) == (t.kind in ("local", "volume"))
    assert isinstance(store, StaleUploads) == (t.kind == "s3")
    assert not isinstance(store, BackgroundCommit)  # only a staged volume has it


def test_a_write_the_store_cannot_take_is_a_checkpoint_error(store):
    sink = _sink(store, "w.bin")
    if store.traits.random_writes and store.traits.min_part_size == 0:
        sink.write_at(7, [b"x"])  # out of order is fine here
        sink.write_at(0, [b"0123456"])
    else:  # in-order stores: a gap; S3: an offset that is not a part boundary
        sink.write_at(0, [b"abc"]) if not store.traits.random_writes else None
        with pytest.raises(CheckpointError, match="in order|multiple of the part size"):
            sink.write_at(100, [b"z"])
    sink.abort()


def test_write_after_close_and_close_after_abort_are_checkpoint_errors(store):
    sink = _sink(store, "a.bin")
    sink.write_at(0, [b"abc"])
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(CheckpointError):
        sink.write_at(3, [b"d"])
    assert store.read_small("a.bin") == b"abc"  # the refused write changed nothing
    other = _sink(store, "b.bin")
    other.write_at(0, [b"xyz"])
    other.abort()
    other.abort()  # idempotent
    with pytest.raises(CheckpointError, match="aborted"):
        other.close()
    assert store.size("b.bin") is None


def test_missing_and_truncated_files_are_incomplete(store):
    with pytest.raises(IncompleteCheckpointError, match="missing") as info:
        store.open_source("missing.bin").read_into(0, [bytearray(4)])  # at the open or the first read
    assert "missing.bin" in info.value.path
    _put(store, "short.bin", b"abc")
    src = store.open_source("short.bin")
    with pytest.raises(IncompleteCheckpointError, match="truncated") as info:
        src.read_into(1, [bytearray(8)])
    src.close()
    assert info.value.byte_range == (1, 9)


def test_absent_files_are_none_or_nothing(store):
    assert store.read_small("nope.json") is None and store.size("nope.json") is None
    store.delete("nope.json")


def test_commit_over_a_record_of_another_writer_is_refused(store):
    store.put_commit_record("manifest.json", b"{first}", replace=False)
    with pytest.raises(CheckpointExistsError, match="committed by another writer"):
        store.put_commit_record("manifest.json", b"{second}", replace=False)
    assert store.read_small("manifest.json") == b"{first}"
    store.put_commit_record("manifest.json", b"{second}", replace=True)
    assert store.read_small("manifest.json") == b"{second}"


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", ""])
def test_unsafe_names_are_checkpoint_errors(store, name):
    for op in (store.size, store.read_small, store.delete, store.open_source, store.open_sink):
        with pytest.raises(CheckpointError, match="file name"):
            op(name)


def test_small_reads_are_capped(store):
    store.put_commit_record("manifest.json", b"x" * 100, replace=True)
    assert store.read_small("manifest.json", max_bytes=100) == b"x" * 100
    with pytest.raises(FileTooLargeError, match="manifest.json.*100 bytes.*over the 99-byte limit") as info:
        store.read_small("manifest.json", max_bytes=99)
    assert "manifest.json" in info.value.path
    store.put_commit_record("empty.json", b"", replace=True)
    assert store.read_small("empty.json", max_bytes=0) == b""


def test_a_staged_volume_commits_in_the_background(tmp_path):
    """The one store with the background-commit ability; its traits are its volume's."""
    store = open_store(tmp_path / "vol" / "ckpt", {"volume": True, "stage_dir": tmp_path / "stage"})
    assert isinstance(store, BackgroundCommit) and not isinstance(store, StaleUploads)
    assert store.traits == open_store(tmp_path / "vol" / "ckpt", {"volume": True}).traits
    assert store.traits.kind == "volume" and not store.traits.atomic_commit_record
