"""Direct (``O_DIRECT``) writes of local data files: the same files and hashes as buffered ones."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.engine.hashed_write import write_hashed_files
from goodput_ckpt.engine.layout import PAGE_ITEM_MIN, place_items
from goodput_ckpt.storage import LocalConfig, LocalStore, direct_write
from goodput_ckpt.storage.direct_write import BOUNCE_BYTES
from goodput_ckpt.tools.ops.verify import verify_checkpoint


class _Bytes:
    """A byte source over memory (the writer's protocol: ``view``, ``release``)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._view = memoryview(data)
        self.nbytes = len(data)

    def view(self, start: int, end: int) -> memoryview:
        return self._view[start:end]

    def release(self) -> None:
        pass


def _write(root, direct: bool, items: list[bytes], *, chunk_size: int, files: int = 1, threads: int = 4):
    store = LocalStore(str(root), LocalConfig(direct_writes=direct))
    store.prepare()
    placements, sizes = place_items([len(b) for b in items], files)
    names = [f"f{i}.bin" for i in range(len(sizes))]
    sources = [_Bytes(bytearray(b)) for b in items]  # writable, as tensors are: the memmove path
    entries = write_hashed_files(store, names, placements, sizes, sources, chunk_size=chunk_size, thread_count=threads)
    return store, entries


def _items(seed: int, sizes: list[int]) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in sizes]


@pytest.mark.parametrize(
    "chunk_size, sizes",
    [
        (8 << 20, [5 << 20, 123, 3 << 20, 77_777]),  # default chunks; a file tail shorter than a block
        (1 << 20, [1_000_003, 4096, 2_500_000]),  # several chunks, the last one unaligned
        (12_800, [100_000, 7]),  # chunks at offsets that are not block-aligned: written buffered
        (BOUNCE_BYTES * 2 + 4096, [BOUNCE_BYTES * 2 + 9000]),  # a chunk larger than a bounce buffer
    ],
)
def test_direct_files_equal_buffered_files(tmp_path, chunk_size, sizes):
    items = _items(1, sizes)
    direct, d_entries = _write(tmp_path / "direct", True, items, chunk_size=chunk_size, files=2)
    buffered, b_entries = _write(tmp_path / "buffered", False, items, chunk_size=chunk_size, files=2)
    assert d_entries == b_entries  # names, sizes and every chunk's digest
    for e in d_entries:
        assert (tmp_path / "direct" / e.path).read_bytes() == (tmp_path / "buffered" / e.path).read_bytes()
        assert os.path.getsize(tmp_path / "direct" / e.path) == e.size


def _direct(store: LocalStore, name: str) -> bool:
    sink = store.open_sink(name)
    try:
        return sink.direct
    finally:
        sink.close()


def test_direct_writes_auto_means_saves_beside_training(tmp_path, roomy_machine):
    # ext4/xfs/tmpfs take O_DIRECT; test_filesystem_without_direct_io_writes_buffered covers one that does not
    auto = LocalStore(str(tmp_path))
    assert auto.config.direct_writes is None
    assert not _direct(auto, "a.bin")  # a save the caller waits for, CPUs to spare: buffered
    assert _direct(auto.for_background_save(), "b.bin")
    assert auto.for_background_save().uri == auto.uri
    off = LocalStore(str(tmp_path), LocalConfig(direct_writes=False))
    assert not _direct(off.for_background_save(), "c.bin")
    on = LocalStore(str(tmp_path), LocalConfig(direct_writes=True))
    assert _direct(on, "d.bin") and _direct(on.for_background_save(), "e.bin")


def test_direct_writes_auto_writes_a_waited_for_save_direct_on_a_contended_machine(tmp_path, contended_machine):
    auto = LocalStore(str(tmp_path))
    assert _direct(auto, "a.bin")
    off = LocalStore(str(tmp_path), LocalConfig(direct_writes=False))
    assert not _direct(off, "b.bin")  # False is never overridden by the machine's state


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` over a private mapping of the file."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.addressof(anchor), size, vec) == 0, ctypes.get_errno()
        finally:
            del anchor
    return sum(1 for b in vec.raw if b & 1)


def _data_files(path) -> list:
    return sorted(p for p in path.iterdir() if p.suffix == ".bin")


def test_async_save_writes_around_the_page_cache_and_a_sync_save_does_not(tmp_path, roomy_machine):
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    fut = dcp.async_save(state, storage_writer=CheckpointWriter(str(tmp_path / "async")), no_dist=True)
    fut.result()
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "sync")), no_dist=True)
    (a,), (s,) = _data_files(tmp_path / "async"), _data_files(tmp_path / "sync")
    # Direct writes leave at most the buffered tail of the file's last block in the cache.
    assert _resident_pages(a) <= 1
    assert _resident_pages(s) > 100  # 4 MiB just written through the page cache
    assert a.read_bytes() == s.read_bytes()
    for d in ("async", "sync"):
        assert verify_checkpoint(str(tmp_path / d)).ok


def test_a_failed_background_save_leaves_no_mark_on_the_next_save(tmp_path, roomy_machine):
    """The writer's mark of a save beside training is for one save: one refused before its
    writes (here: the step exists) does not make the next, synchronous save write direct."""
    state = {"w": torch.randn(1 << 20)}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=CheckpointWriter(str(path)), no_dist=True)
    writer = CheckpointWriter(str(path))
    writer.mark_background_save()
    with pytest.raises(BaseException, match="already"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    shutil.rmtree(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    (f,) = _data_files(path)
    assert _resident_pages(f) > 100  # written through the page cache


def test_filesystem_without_direct_io_writes_buffered(ramfs, tmp_path):
    items = _items(2, [3 << 20, 1234])
    store, entries = _write(ramfs / "ckpt", True, items, chunk_size=1 << 20)
    assert not store.open_sink("probe.bin").direct
    _ref, expected = _write(tmp_path / "ref", False, items, chunk_size=1 << 20)
    assert entries == expected
    assert (ramfs / "ckpt" / "f0.bin").read_bytes() == (tmp_path / "ref" / "f0.bin").read_bytes()


def test_direct_write_refused_after_open_falls_back_and_the_checkpoint_is_correct(big_sector_fs, tmp_path):
    """A device whose sectors (16 KiB) are larger than our alignment: ``O_DIRECT`` opens, the first
    direct write gets ``EINVAL``, and that chunk and every later one are written buffered."""
    items = _items(3, [3 << 20, 1234, 5 << 20])
    store = LocalStore(str(big_sector_fs / "probe"), LocalConfig(direct_writes=True))
    store.prepare()
    assert _direct(store, "p.bin")  # the open is not refused: only the writes are
    store, entries = _write(big_sector_fs / "ckpt", True, items, chunk_size=1 << 20)
    _ref, expected = _write(tmp_path / "ref", False, items, chunk_size=1 << 20)
    assert entries == expected
    assert (big_sector_fs / "ckpt" / "f0.bin").read_bytes() == (tmp_path / "ref" / "f0.bin").read_bytes()
    sink = store.open_sink("after.bin")
    sink.write_hashed(0, [bytearray(8192)], _Hasher())
    assert not sink.direct  # refused at its first write: the rest of the file goes buffered
    sink.close()
    state = {"w": torch.randn(1000, 1001), "i": torch.arange(7, dtype=torch.int16)}
    path = str(big_sector_fs / "dcp")
    dcp.save(state, storage_writer=CheckpointWriter(path, direct_writes=True), no_dist=True)
    assert verify_checkpoint(path).ok
    out = {"w": torch.empty(1000, 1001), "i": torch.empty(7, dtype=torch.int16)}
    dcp.load(out, storage_reader=CheckpointReader(path, verify=True), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["i"], state["i"])


class _Hasher:
    def update(self, b) -> None:
        pass


def test_dcp_save_with_direct_writes_verifies_and_loads_bit_exact(tmp_path):
    state = {
        "w": torch.randn(1000, 1001),
        "t": torch.randn(300, 77).t(),  # not contiguous
        "i": torch.arange(5, dtype=torch.int16),
        "o": {"lr": 0.1, "name": "adamw"},
    }
    for direct in (True, False):
        dcp.save(
            state, storage_writer=CheckpointWriter(str(tmp_path / str(direct)), direct_writes=direct), no_dist=True
        )
        report = verify_checkpoint(str(tmp_path / str(direct)))
        assert report.ok, report
        out = {
            "w": torch.empty(1000, 1001),
            "t": torch.empty(77, 300),
            "i": torch.empty(5, dtype=torch.int16),
            "o": {"lr": 0.0, "name": ""},
        }
        dcp.load(out, storage_reader=CheckpointReader(str(tmp_path / str(direct)), verify=True), no_dist=True)
        assert all(torch.equal(out[k], state[k]) for k in ("w", "t", "i")) and out["o"] == state["o"]
    files = {d: sorted(p for p in os.listdir(tmp_path / d) if p.endswith(".bin")) for d in ("True", "False")}
    assert [os.path.getsize(tmp_path / "True" / f) for f in files["True"]] == [
        os.path.getsize(tmp_path / "False" / f) for f in files["False"]
    ]


def test_direct_writes_option_is_checked():
    with pytest.raises(TypeError, match="direct_writes must be a bool"):
        LocalConfig(direct_writes="yes")  # type: ignore[arg-type]


def test_without_fsync_writes_stay_buffered(tmp_path):
    # Scratch data and a volume save's local staging are read back at once: from the page cache.
    sink = LocalStore(str(tmp_path), LocalConfig(fsync=False, direct_writes=True)).open_sink("a.bin")
    assert not sink.direct
    sink.close()


def test_async_save_to_a_volume_path_is_unchanged(tmp_path):
    # A volume store is a LocalStore with its own configuration and sink: no direct writes there.
    state = {"w": torch.randn(1000)}
    dcp.async_save(state, storage_writer=CheckpointWriter(str(tmp_path / "v"), volume=True), no_dist=True).result()
    assert verify_checkpoint(str(tmp_path / "v")).ok


def test_manager_async_saves_write_direct_and_sync_saves_buffered(tmp_path, roomy_machine):
    from goodput_ckpt import CheckpointManager

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    for async_save in (True, False):
        root = tmp_path / str(async_save)
        with CheckpointManager(root, async_save=async_save) as mgr:
            mgr.save(1, model=model)
            mgr.wait()
        biggest = max(root.rglob("*.bin"), key=lambda p: p.stat().st_size)
        assert biggest.stat().st_size > 4 << 20
        if async_save:
            assert _resident_pages(biggest) <= 1
        else:
            assert _resident_pages(biggest) > 100


class _Counted:
    """Counts the bounce buffers the direct writer takes (the copies it makes)."""

    def __init__(self, monkeypatch) -> None:
        self.takes = 0
        real = direct_write._POOL.take

        def take():
            self.takes += 1
            return real()

        monkeypatch.setattr(direct_write._POOL, "take", take)


def _aligned(data: bytes) -> memoryview:
    """``data`` in page-aligned, writable memory (as a manager's staging buffer is)."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


@pytest.mark.parametrize(
    "sizes",
    [
        [3 << 20, 5 << 20],  # chunks that are each one aligned buffer
        [BOUNCE_BYTES * 2 + 9000],  # larger than a bounce buffer, with an unaligned tail
        [(1 << 20) + 100, 8192, 2 << 20],  # an item after an unaligned one: its offset is page-aligned by the layout
    ],
)
def test_page_aligned_buffers_are_written_where_they_lie(tmp_path, monkeypatch, sizes):
    """A page-aligned buffer at a page-aligned position goes from its own memory to the device: no
    bounce buffer for it, and the same files and digests as a buffered write of the same bytes."""
    items = _items(5, sizes)
    counted = _Counted(monkeypatch)
    store = LocalStore(str(tmp_path / "direct"), LocalConfig(direct_writes=True))
    store.prepare()
    placements, file_sizes = place_items([len(b) for b in items], 1)
    assert all(p.offset % 4096 == 0 for p in placements if p.length >= PAGE_ITEM_MIN)
    sources = [_Bytes(_aligned(b)) for b in items]
    entries = write_hashed_files(store, ["f0.bin"], placements, file_sizes, sources, chunk_size=8 << 20, thread_count=2)
    _ref, expected = _write(tmp_path / "buffered", False, items, chunk_size=8 << 20)
    assert entries == expected
    assert (tmp_path / "direct" / "f0.bin").read_bytes() == (tmp_path / "buffered" / "f0.bin").read_bytes()
    tails = sum(1 for b in items if len(b) % 4096) + sum(1 for b in items if len(b) < PAGE_ITEM_MIN)
    assert counted.takes <= tails  # only unaligned tails and small items go through a bounce buffer
    counted.takes = 0
    _write(tmp_path / "copied", True, items, chunk_size=8 << 20)  # the same bytes in unaligned memory
    assert counted.takes >= -(-file_sizes[0] // (8 << 20))  # a bounce buffer for every chunk


def test_in_place_write_refused_falls_back_to_buffered(big_sector_fs, tmp_path):
    items = _items(6, [3 << 20, 2 << 20])
    placements, file_sizes = place_items([len(b) for b in items], 1)
    store = LocalStore(str(big_sector_fs / "ckpt"), LocalConfig(direct_writes=True))
    store.prepare()
    sources = [_Bytes(_aligned(b)) for b in items]
    entries = write_hashed_files(store, ["f0.bin"], placements, file_sizes, sources, chunk_size=1 << 20, thread_count=2)
    _ref, expected = _write(tmp_path / "ref", False, items, chunk_size=1 << 20)
    assert entries == expected
    assert (big_sector_fs / "ckpt" / "f0.bin").read_bytes() == (tmp_path / "ref" / "f0.bin").read_bytes()


def test_manager_staging_buffers_are_page_aligned_and_written_in_place(tmp_path, roomy_machine, monkeypatch):
    from goodput_ckpt import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1000), torch.nn.Linear(1000, 1024))  # 4 MB weights
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    counted = _Counted(monkeypatch)
    with CheckpointManager(tmp_path / "root", async_save=True, keep_last=None) as mgr:
        mgr.save(1, model=model, optimizer=opt)
        mgr.wait()
        staged = [b for b in mgr._staging.stager._buffers.values() if b.nbytes >= PAGE_ITEM_MIN]
        assert len(staged) == 6 and all(b.data_ptr() % 4096 == 0 for b in staged)
        counted.takes = 0
        mgr.save(2, model=model, optimizer=opt)
        mgr.wait()
    # 6 large tensors of 4 MB (weights, exp_avg, exp_avg_sq) in chunks of 8 MiB, written in place;
    # only chunks holding a small item or an unaligned tail took a bounce buffer.
    assert counted.takes <= 4
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 1000), torch.nn.Linear(1000, 1024))
    with CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.restore(model=fresh) == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
