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
    threads = [
        threading.Thread(target=sink.write_at, args=(i * 1000, [blocks[i][:300], blocks[i][300:]])) for i in range(16)
    ]
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


def test_small_reads_refuse_huge_and_endless_files_before_reading_them(tmp_path):
    """A manifest that is a 3 GiB sparse file, a FIFO, a device or a link to one is refused with
    no read of its content (before: read whole, then checked, or a wait for a FIFO's writer)."""
    from goodput_ckpt.engine.manifest_load import load_manifest
    from goodput_ckpt.errors import CorruptCheckpointError, FileTooLargeError
    from goodput_ckpt.storage.base import SMALL_FILE_LIMIT

    store = LocalStore(str(tmp_path / "loc"))
    store.prepare()
    sparse = tmp_path / "loc" / "manifest.json"
    with open(sparse, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB that occupy no disk: reading it whole would need 3 GiB of memory
    with pytest.raises(
        FileTooLargeError, match=rf"manifest.json holds {3 << 30} bytes, over the {SMALL_FILE_LIMIT}-byte limit"
    ):
        store.read_small("manifest.json")
    with pytest.raises(CorruptCheckpointError, match="over the"):  # what a load reports
        load_manifest(store)
    with pytest.raises(FileTooLargeError):
        store.read_small("manifest.json", max_bytes=10)
    sparse.unlink()
    os.mkfifo(tmp_path / "loc" / "fifo.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        store.read_small("fifo.json")  # opening a FIFO would wait for a writer forever
    os.symlink("/dev/zero", tmp_path / "loc" / "zero.json")
    with pytest.raises(CheckpointError, match="symbolic link"):
        store.read_small("zero.json")
    if os.geteuid() == 0:  # a device node itself inside the location
        import stat

        os.mknod(tmp_path / "loc" / "dev.json", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        with pytest.raises(CheckpointError, match="not a regular file"):
            store.read_small("dev.json")


def test_a_closed_sink_takes_no_writes_and_an_aborted_one_cannot_close(tmp_path):
    """Before: a write after close went to whatever file had reused the descriptor's number, and
    close after abort returned as if the file were complete."""
    store = LocalStore(str(tmp_path / "loc"))
    store.prepare()
    sink = store.open_sink("a.bin")
    sink.write_at(0, [b"abc"])
    sink.close()
    reused = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)  # likely the freed number
    try:
        with pytest.raises(CheckpointError, match="closed"):
            sink.write_at(3, [b"d"])
    finally:
        os.close(reused)
    assert (tmp_path / "other").read_bytes() == b""
    aborted = store.open_sink("b.bin")
    aborted.abort()
    with pytest.raises(CheckpointError, match="aborted"):
        aborted.close()


def test_buffered_writes_to_one_file_are_copied_one_at_a_time(tmp_path, monkeypatch):
    """Writer threads copy into the page cache one at a time (the kernel serializes buffered
    writes to a file anyway, and its waiters spin on the CPUs first: storage/local_sink.py)."""
    import goodput_ckpt.storage.local_sink as sink_mod

    real, lock = os.pwritev, threading.Lock()
    inside, most, arrived = [0], [0], threading.Event()

    def pwritev(fd, views, offset):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] > 1:
                arrived.set()
        arrived.wait(0.2)  # hold the call open so that an unserialized second writer gets in
        try:
            return real(fd, views, offset)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(sink_mod.os, "pwritev", pwritev)
    store = LocalStore(str(tmp_path / "loc"), LocalConfig(direct_writes=False))
    store.prepare()
    sink = store.open_sink("data.bin")
    blocks = [bytes([i]) * 4096 for i in range(6)]
    threads = [threading.Thread(target=sink.write_at, args=(i * 4096, [blocks[i]])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    assert most[0] == 1
    assert (tmp_path / "loc" / "data.bin").read_bytes() == b"".join(blocks)


@pytest.mark.parametrize("direct", [False, True])
def test_a_data_file_is_allocated_at_its_size_before_its_chunks_arrive(tmp_path, monkeypatch, direct):
    """write_hashed_files reserves each local file's size first (fallocate: chunks then fill
    allocated blocks instead of extending the file under its inode lock), and the file that
    results is the same."""
    from goodput_ckpt.engine.hashed_write import write_hashed_files
    from goodput_ckpt.engine.layout import place_items
    from goodput_ckpt.storage.local_sink import LocalSink

    seen: list[tuple[int, int, int]] = []
    real = LocalSink.reserve

    def reserve(self, size):
        real(self, size)
        st = os.fstat(self._fd)
        seen.append((size, st.st_size, st.st_blocks * 512))

    monkeypatch.setattr(LocalSink, "reserve", reserve)
    items = [os.urandom(3 << 20), os.urandom(1234), os.urandom(2 << 20)]
    store = LocalStore(str(tmp_path / "loc"), LocalConfig(direct_writes=direct))
    store.prepare()
    placements, sizes = place_items([len(b) for b in items], 2)

    class _Bytes:
        def __init__(self, data: bytes) -> None:
            self._view, self.nbytes = memoryview(bytearray(data)), len(data)

        def view(self, start, end):
            return self._view[start:end]

        def release(self):
            pass

    names = ["f0.bin", "f1.bin"]
    entries = write_hashed_files(
        store, names, placements, sizes, [_Bytes(b) for b in items], chunk_size=1 << 20, thread_count=4
    )
    assert [s[0] for s in seen] == sizes  # once per file, before any chunk: its size is already final
    assert all(size == st_size and allocated >= size for size, st_size, allocated in seen)
    for entry, placed in zip(entries, [[p for p in placements if p.file == f] for f in range(2)]):
        data = (tmp_path / "loc" / entry.path).read_bytes()
        assert len(data) == entry.size
        for p in placed:
            assert data[p.offset : p.offset + p.length] == items[p.item]


def test_reserve_is_a_hint_where_the_filesystem_has_no_fallocate(tmp_path, monkeypatch):
    import goodput_ckpt.storage.local_sink as sink_mod

    def refused(fd, mode, offset, length):
        return -1  # EOPNOTSUPP on a filesystem without it, ENOSPC on a full disk: writes decide

    monkeypatch.setattr(sink_mod, "_FALLOCATE", refused)
    store = LocalStore(str(tmp_path / "loc"))
    store.prepare()
    sink = store.open_sink("data.bin")
    sink.reserve(8192)
    sink.write_at(0, [b"a" * 5000])
    sink.close()
    assert (tmp_path / "loc" / "data.bin").read_bytes() == b"a" * 5000
