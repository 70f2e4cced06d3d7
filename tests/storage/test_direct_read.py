"""Direct (page-cache-free) reads of the local and volume stores (storage/direct_read.py), on
real filesystems: ext4 under the temporary directory, and a ramfs mount, which refuses O_DIRECT."""

from __future__ import annotations

import ctypes
import mmap
import os
import random

import pytest

from goodput_ckpt.errors import CheckpointError, IncompleteCheckpointError
from goodput_ckpt.storage import LocalConfig, LocalStore
from goodput_ckpt.storage.direct_read import ALIGN

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def _cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a fresh mapping of it)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    try:
        if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)
    return sum(b & 1 for b in vec.raw)


def _write_uncached(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _ranges(rnd: random.Random, size: int, count: int):
    for _ in range(count):
        off = rnd.randrange(0, size - 1)
        if rnd.random() < 0.3:
            off -= off % ALIGN
        n = rnd.randrange(1, min(size - off, 9 << 20) + 1)
        cuts = sorted(rnd.sample(range(1, n), min(rnd.randrange(0, 3), n - 1))) if n > 1 else []
        bounds = [0, *cuts, n]
        yield off, [bytearray(b - a) for a, b in zip(bounds, bounds[1:])]


def test_local_reads_bypass_the_page_cache(tmp_path):
    """A load reads each byte once from the device: nothing of the file lands in the page cache,
    whether the destination is aligned (read in place) or not (through a bounce buffer)."""
    data = os.urandom((6 << 20) + 123)
    path = str(tmp_path / "d.bin")
    _write_uncached(path, data)
    if _cached_pages(path):
        pytest.skip("this filesystem keeps the file cached after POSIX_FADV_DONTNEED")
    src = LocalStore(str(tmp_path), LocalConfig(direct_reads=True)).open_source("d.bin")
    aligned = mmap.mmap(-1, 4 << 20)
    src.read_into(0, [memoryview(aligned)])
    unaligned = bytearray((2 << 20) + 123 - 64)
    src.read_into((4 << 20) + 64, [unaligned])
    src.close()
    assert bytes(aligned) == data[: 4 << 20] and bytes(unaligned) == data[(4 << 20) + 64 :]
    assert _cached_pages(path) == 0


def test_local_direct_reads_return_the_bytes_of_any_range(tmp_path):
    data = os.urandom((9 << 20) + 123)
    (tmp_path / "d.bin").write_bytes(data)
    src = LocalStore(str(tmp_path), LocalConfig(direct_reads=True)).open_source("d.bin")
    assert src.level == "aligned"
    for off, bufs in _ranges(random.Random(0), len(data), 60):
        src.read_into(off, bufs)
        assert b"".join(bufs) == data[off : off + sum(map(len, bufs))]
    with pytest.raises(IncompleteCheckpointError) as info:
        src.read_into(len(data) - 10, [bytearray(20)])
    assert info.value.byte_range == (len(data) - 10, len(data) + 10)
    with pytest.raises(IncompleteCheckpointError):
        src.read_into(len(data) + 5000, [bytearray(10)])
    src.close()
    with pytest.raises(CheckpointError, match="closed"):
        src.read_into(0, [bytearray(1)])


def test_local_reads_are_buffered_by_default(tmp_path):
    """The default, measured faster on the development machine's disk (docs/benchmarks.md)."""
    data = os.urandom(10_000)
    (tmp_path / "d.bin").write_bytes(data)
    for store in (LocalStore(str(tmp_path)), LocalStore(str(tmp_path), LocalConfig(direct_reads=False))):
        src = store.open_source("d.bin")
        assert src.level == "buffered" and not src.direct
        buf = bytearray(100)
        src.read_into(7, [buf])
        assert bytes(buf) == data[7:107]
        src.close()
    with pytest.raises(TypeError, match="direct_reads"):
        LocalConfig(direct_reads=1)


def test_buffered_reads_fill_typed_buffers_and_stream_one_descriptor(tmp_path):
    """Buffers of any item size are filled byte for byte (each is cast to bytes once); a read
    that starts where the last one ended takes that read's descriptor (its end is the bytes
    read), so a reader going through a file in order keeps one descriptor."""
    import numpy as np

    from goodput_ckpt.storage.direct_read import read_full

    data = os.urandom(1 << 16)
    (tmp_path / "d.bin").write_bytes(data)
    fd = os.open(tmp_path / "d.bin", os.O_RDONLY)
    try:
        a, b = np.zeros(100, np.uint16), np.zeros(3, np.uint64)
        assert read_full(fd, "d.bin", 5, [memoryview(a), memoryview(b)]) == 224
        assert a.tobytes() + b.tobytes() == data[5:229]
    finally:
        os.close(fd)
    src = LocalStore(str(tmp_path)).open_source("d.bin")
    opened = []
    real = src._open
    src._open = lambda: opened.append(1) or real()
    offset, pieces = 0, []
    for n in (500, 2048, 3, 10000):  # uint16 items: 2n bytes
        buf = np.zeros(n, np.uint16)
        src.read_into(offset, [memoryview(buf)[: n // 2], memoryview(buf)[n // 2 :]])
        pieces.append(buf.tobytes())
        offset += 2 * n
    assert b"".join(pieces) == data[:offset]
    assert src._idle[0][1] == offset and len(src._idle) == 1 and not opened, "one descriptor, streaming"
    src.read_into(7, [bytearray(10)])  # no descriptor ends at 7: the idle one is taken anyway
    assert not opened
    src.close()


def test_filesystems_refusing_o_direct_are_read_buffered(ramfs):
    from goodput_ckpt.storage import VolumeStore

    data = os.urandom((1 << 20) + 7)
    (ramfs / "d.bin").write_bytes(data)
    for store in (LocalStore(str(ramfs), LocalConfig(direct_reads=True)), VolumeStore(str(ramfs))):
        src = store.open_source("d.bin")
        assert src.level == "buffered"
        for off, bufs in _ranges(random.Random(1), len(data), 10):
            src.read_into(off, bufs)
            assert b"".join(bufs) == data[off : off + sum(map(len, bufs))]
        src.close()


def test_direct_reads_never_follow_a_link(tmp_path):
    (tmp_path / "outside.bin").write_bytes(b"secret" * 1000)
    loc = tmp_path / "ckpt"
    loc.mkdir()
    (loc / "d.bin").symlink_to(tmp_path / "outside.bin")
    for direct in (True, False):
        with pytest.raises(CheckpointError, match="link"):
            LocalStore(str(loc), LocalConfig(direct_reads=direct)).open_source("d.bin")
