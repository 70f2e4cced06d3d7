"""The generic fsspec store, on fsspec's in-memory filesystem (``memory://``)."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch.distributed.checkpoint as dcp
from helpers.trees import assert_tree_equal, make_state, zeros_like

from goodput_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointReader,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.storage import FsspecConfig, FsspecStore, is_supported_uri, open_store


@pytest.fixture
def mem_uri():
    """A fresh location on the process-wide memory filesystem, removed afterwards."""
    root = f"goodput-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}/ckpt"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


def test_round_trip_and_corruption(mem_uri):
    sd = make_state(numel=300_000)
    dcp.save(sd, storage_writer=CheckpointWriter(mem_uri, chunk_size=64 << 10))
    store = open_store(mem_uri)
    assert isinstance(store, FsspecStore) and not store.traits.random_writes
    names = store.list()
    assert "manifest.json" in names and len(names) > 2, "sequential store: several files per rank"
    dest = zeros_like(sd)
    dcp.load(dest, storage_reader=CheckpointReader(mem_uri))
    assert_tree_equal(dest, sd)
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=CheckpointWriter(mem_uri))
    assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)

    # Flip one byte of the largest data file: the load names it.
    fs = fsspec.filesystem("memory")
    name = max((n for n in names if n.endswith(".bin")), key=store.size)
    path = mem_uri.removeprefix("memory:/") + "/" + name
    data = bytearray(fs.cat_file(path))
    data[100_000] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(BaseException) as info:
        dcp.load(zeros_like(sd), storage_reader=CheckpointReader(mem_uri))
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and err.path == f"{mem_uri}/{name}"


def test_store_primitives(mem_uri):
    store = open_store(mem_uri)
    store.prepare()
    sink = store.open_sink("d/x.bin")
    sink.write_at(0, [b"abc", memoryview(b"defg")])
    with pytest.raises(CheckpointError, match="in order"):
        sink.write_at(100, [b"z"])
    sink.write_at(7, [b"h"])
    sink.close()
    sink.close()
    assert store.size("d/x.bin") == 8 and store.read_small("d/x.bin") == b"abcdefgh"
    src = store.open_source("d/x.bin")
    a, b = bytearray(2), bytearray(3)
    src.read_into(2, [a, b])
    assert bytes(a + b) == b"cdefg"
    with pytest.raises(IncompleteCheckpointError) as info:
        src.read_into(6, [bytearray(5)])
    assert info.value.byte_range == (6, 11)
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        store.open_source("nope.bin").read_into(0, [bytearray(1)])
    dropped = store.open_sink("dropped.bin")
    dropped.write_at(0, [b"partial"])
    dropped.abort()
    dropped.abort()
    assert store.size("dropped.bin") is None and store.read_small("nope") is None
    store.put_commit_record("manifest.json", b"one", replace=False)
    with pytest.raises(CheckpointExistsError):
        store.put_commit_record("manifest.json", b"two", replace=False)
    store.put_commit_record("manifest.json", b"three", replace=True)
    assert store.read_small("manifest.json") == b"three"
    assert store.list() == ["d/x.bin", "manifest.json"]
    store.delete("d/x.bin")
    store.delete("d/x.bin")
    assert store.list() == ["manifest.json"]
    assert open_store(mem_uri + "-none").list() == []


def test_options_and_uris(mem_uri):
    assert is_supported_uri("memory://x/y") and is_supported_uri("gs://bucket/x")
    assert not is_supported_uri("nosuchproto://x")
    with pytest.raises(ValueError, match="unsupported checkpoint URI"):
        open_store("nosuchproto://x")
    with pytest.raises(TypeError, match="unknown option"):
        open_store(mem_uri, {"endpoint_url": "http://x"})
    fs = fsspec.filesystem("memory")
    assert open_store(mem_uri, {"filesystem": fs}).config.filesystem is fs
    # One whole-object PUT commits atomically; sftp/ftp write the record in place (not atomic).
    gs = FsspecStore("gs://bucket/x", FsspecConfig())  # built directly: open_store refuses gs:// without gcsfs
    assert open_store(mem_uri).traits.atomic_commit_record and gs.traits.atomic_commit_record
    assert not FsspecStore("sftp://host/x", FsspecConfig()).traits.atomic_commit_record
    assert not open_store("ftp://host/x").traits.atomic_commit_record
    with pytest.raises(ValueError, match="either filesystem or storage_options"):
        FsspecConfig(filesystem=fs, storage_options={"a": 1})
    with pytest.raises(TypeError):
        FsspecConfig(storage_options=[("a", 1)])
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="extra package"):
            gs.list()


def test_a_protocol_whose_package_is_missing_is_refused_up_front():
    """``gs://`` without gcsfs (issue 20): a ValueError naming the package, before any work;
    the CLI reports it as exit 2 (environment), not as a failed check."""
    import importlib.util

    from goodput_ckpt.cli import EXIT_USAGE, main
    from goodput_ckpt.storage import open_store

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(ValueError, match="install gcsfs"):
        open_store("gs://bucket/run/step_1")
    assert main(["verify", "gs://bucket/run/step_1"]) == EXIT_USAGE


def test_local_urls_are_the_local_disk_store(tmp_path):
    from goodput_ckpt.storage import LocalStore, open_store

    store = open_store(f"local://{tmp_path}/ck")
    assert isinstance(store, LocalStore) and store.traits.local_path == f"{tmp_path}/ck"
