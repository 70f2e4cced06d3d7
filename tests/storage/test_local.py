"""The local-disk store on a real filesystem."""

from __future__ import annotations

import os
import threading

import pytest

from goodput_ckpt.errors import CheckpointError, CheckpointExistsError, IncompleteCheckpointError
from goodput_ckpt.storage import LocalConfig, LocalStore, check_relative_name, open_store


def test_parallel_writes_and_ranged_reads(tmp_path):
    store = LocalStore(str(tmp_path / "loc"))
    store.prepare()
    sink = store.open_sink("data.bin")
    blocks = [bytes([i]) * 1000 for i in range(16)]
    threads = [threading.Thread(target=sink.write_at, args=(i * 1000, [blocks[i][:300], blocks[i][300:]])) for i in range(16)]
    for t in reversed(threads):
        t.start()
    for t in threads:
        t.join()
    sink.close()
    sink.close()  # idempotent
    assert store.size("data.bin") == 16000
    src = store.open_source("data.bin")
    a, b = bytearray(10), bytearray(990)
    src.read_into(5000, [a, b])
    assert bytes(a + b) == blocks[5]
    with pytest.raises(IncompleteCheckpointError) as info:
        src.read_into(15990, [bytearray(20)])
    assert info.value.byte_range == (15990, 16010)
    src.close()


def test_commit_record_is_exclusive_unless_replace(tmp_path):
    store = LocalStore(str(tmp_path))
    store.put_commit_record("manifest.json", b"one", replace=False)
    with pytest.raises(CheckpointExistsError):
        store.put_commit_record("manifest.json", b"two", replace=False)
    assert store.read_small("manifest.json") == b"one"
    store.put_commit_record("manifest.json", b"three", replace=True)
    assert store.read_small("manifest.json") == b"three"
    assert store.list() == ["manifest.json"], "no temporary files are left behind"


def test_abort_removes_file_and_missing_files(tmp_path):
    store = LocalStore(str(tmp_path))
    sink = store.open_sink("x.bin")
    sink.write_at(0, [b"abc"])
    sink.abort()
    sink.abort()
    assert store.size("x.bin") is None
    assert store.read_small("nope") is None
    store.delete("nope")
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        store.open_source("nope")


def test_disk_errors_become_checkpoint_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not a directory"):
        LocalStore(str(blocker)).prepare()
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="permission"):
            LocalStore(str(ro)).open_sink("a.bin")


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a\\b", "C:x", "a\x00b"])
def test_unsafe_names_rejected(tmp_path, bad):
    with pytest.raises(CheckpointError):
        check_relative_name(bad)
    with pytest.raises(CheckpointError):
        LocalStore(str(tmp_path)).open_sink(bad)


def test_open_store_options():
    assert isinstance(open_store("/tmp/x"), LocalStore)
    assert open_store("file:///tmp/x").root == "/tmp/x"
    assert open_store("/tmp/x", {"fsync": False}).config == LocalConfig(fsync=False)
    with pytest.raises(TypeError, match="unknown option"):
        open_store("/tmp/x", {"fsnc": False})
    with pytest.raises(TypeError):
        LocalConfig(fsync="yes")
    with pytest.raises(ValueError):
        open_store("nosuchscheme://host/x")
