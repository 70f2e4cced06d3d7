"""``CheckpointReader``'s sequential runs: on stores that read files as streams (mounted volumes),
a run of several tasks hashes each task on a helper thread while it reads the next. A damaged
chunk must still fail the load, named by file and byte range, wherever it sits in a run."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.trees import zeros_like
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointReader, CheckpointWriter, CorruptCheckpointError
from goodput_ckpt.dcp import reader as reader_mod
from goodput_ckpt.dcp.read_sources import ReadSources
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest

KiB = 1 << 10
CHUNK = 64 * KiB
TASK = 256 * KiB  # four hash chunks a task, so a file of ~1 MiB is a run of four tasks


def _state() -> dict[str, torch.Tensor]:
    """Sixteen equal tensors (not :func:`helpers.make_state`): enough items to fill four files
    with several read tasks each."""
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(256 * KiB // 4, generator=g) for i in range(16)}  # 4 MiB


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """A volume-mode checkpoint of four ~1 MiB files, read in 256 KiB tasks."""
    monkeypatch.setattr(reader_mod, "TASK_BYTES", TASK)
    loc = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=CheckpointWriter(loc, volume=True, chunk_size=CHUNK, files_per_rank=4))
    manifest = parse_manifest((loc / MANIFEST_NAME).read_bytes())
    assert len(manifest.files) == 4 and all(f.size >= 4 * TASK for f in manifest.files.values())
    return loc, manifest


def _load(loc, verify: bool = True, thread_count: int | None = None, **sources) -> dict[str, torch.Tensor]:
    """A load through a reader given ``ReadSources(**sources)``."""
    dest = zeros_like(_state())
    reader = CheckpointReader(
        loc, volume=True, verify=verify, thread_count=thread_count, sources=ReadSources(**sources)
    )
    dcp.load(dest, storage_reader=reader)
    return dest


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_runs_hash_on_helper_threads_and_load_exactly(runs, threads, monkeypatch):
    loc, _ = runs
    hashed_on: list[str] = []
    verify = reader_mod.CheckpointReader._verify

    def spy(self, *args, **kwargs):
        hashed_on.append(threading.current_thread().name)
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(reader_mod.CheckpointReader, "_verify", spy)
    out = _load(loc, thread_count=threads)
    assert all(torch.equal(out[k], v) for k, v in _state().items())
    assert len(hashed_on) == 16, "every task is verified once"
    helpers = [n for n in hashed_on if n.startswith("goodput-hash")]
    assert helpers and len(helpers) < len(hashed_on), "the last task of a run is hashed by its reader"


@pytest.mark.parametrize("task_index", [0, 1, 3])  # the first, a middle and the last task of a run
@pytest.mark.parametrize("threads", [1, 8])
def test_a_damaged_chunk_anywhere_in_a_run_fails_the_load_by_name(runs, task_index, threads):
    loc, manifest = runs
    name = sorted(manifest.files)[1]
    at = task_index * TASK + TASK // 2 + 7
    path = loc / name
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load(loc, thread_count=threads)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError), info.value
    assert name in str(err) and err.byte_range is not None
    lo, hi = err.byte_range
    assert lo <= at < hi and hi - lo <= TASK, (err.byte_range, at)
    assert _load(loc, thread_count=threads, verify=False) is not None  # the damage is only in the hash


def test_dcp_load_of_an_uncommitted_save_gives_the_typed_error_back(tmp_path):
    """torch 2.13 turns read_metadata's error into a bare AssertionError (issue 20, item 6):
    find_checkpoint_error still returns our IncompleteCheckpointError, with its path."""
    from goodput_ckpt.errors import IncompleteCheckpointError, find_checkpoint_error

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "rank0.bin").write_bytes(b"\0" * 8)
    with pytest.raises(BaseException) as e:
        dcp.load({"w": torch.empty(2)}, storage_reader=CheckpointReader(str(tmp_path / "x")), no_dist=True)
    err = find_checkpoint_error(e.value)
    assert isinstance(err, IncompleteCheckpointError) and err.path == str(tmp_path / "x"), repr(e.value)


@pytest.mark.parametrize("volume", [True, False])
def test_checked_files_are_read_without_hashing_and_the_others_still_are(runs, volume):
    """``checked_files`` (files a two-tier restore checked on arrival) are read unhashed, and
    exactly: a damaged one loads its damaged bytes, while damage in any other file still fails
    the load by name."""
    loc, manifest = runs
    checked, other = sorted(manifest.files)[:2]
    at = TASK + 11
    for name in (checked, other):
        data = bytearray((loc / name).read_bytes())
        data[at] ^= 0x10
        (loc / name).write_bytes(bytes(data))
    dest = zeros_like(_state())
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            dest, storage_reader=CheckpointReader(loc, volume=volume, sources=ReadSources(checked_files={checked}))
        )
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and other in str(err) and checked not in str(err), err
    # Restore the other file: now only the checked file is damaged, and the load does not notice.
    data = bytearray((loc / other).read_bytes())
    data[at] ^= 0x10
    (loc / other).write_bytes(bytes(data))
    dest = zeros_like(_state())
    dcp.load(dest, storage_reader=CheckpointReader(loc, volume=volume, sources=ReadSources(checked_files={checked})))
    want = _state()
    differ = [k for k in want if not torch.equal(dest[k], want[k])]
    assert len(differ) == 1, differ  # the damaged bytes landed, unhashed: one tensor differs, by one byte
    with pytest.raises(CheckpointException):
        _load(loc)  # without checked_files the same file fails the load


def test_a_manifest_the_caller_read_is_used_instead_of_reading_it_again(runs):
    """``manifest=`` (a two-tier restore has the agreed commit record parsed): the load reads no
    manifest, and still checks every chunk against the one it was given."""
    loc, manifest = runs
    (loc / MANIFEST_NAME).rename(loc / "elsewhere.json")  # a load that read it would fail
    want = _state()
    got = _load(loc, manifest=manifest, partial=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(CheckpointException):
        _load(loc, partial=True)  # without it, the missing record fails the load
    name = sorted(manifest.files)[0]
    data = bytearray((loc / name).read_bytes())
    data[TASK + 11] ^= 0x10
    (loc / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load(loc, manifest=manifest, partial=True)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and name in str(err), err


def test_files_read_from_another_store_come_from_it_and_are_always_verified(runs, tmp_path):
    """``read_from`` (a two-tier restore reads the files its node's copy lacks from the
    persistent tier): those files are read from the given store and loaded exactly, even when
    missing from the location; they are hashed even with ``verify=False``, and a damaged one
    is named at the store it came from. The location's own files follow ``verify``."""
    import shutil

    from goodput_ckpt.storage import open_store

    loc, manifest = runs
    other = tmp_path / "other"
    shutil.copytree(loc, other)
    moved, kept = sorted(manifest.files)[:2]
    (loc / moved).unlink()  # only the other store has it
    want = _state()
    elsewhere = {moved: open_store(str(other), {})}
    got = _load(loc, manifest=manifest, partial=True, read_from=elsewhere)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(CheckpointException):
        _load(loc, manifest=manifest, partial=True)  # without read_from the missing file fails it
    for path in (other / moved, loc / kept):
        data = bytearray(path.read_bytes())
        data[TASK + 11] ^= 0x10
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _load(loc, manifest=manifest, partial=True, read_from=elsewhere, verify=False)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and str(other / moved) in str(err), err
    # The location's own damaged file, unverified, loads its damaged bytes once the other is good.
    data = bytearray((other / moved).read_bytes())
    data[TASK + 11] ^= 0x10
    (other / moved).write_bytes(bytes(data))
    got = _load(loc, manifest=manifest, partial=True, read_from=elsewhere, verify=False)
    assert sum(not torch.equal(got[k], want[k]) for k in want) == 1


def test_read_sources_default_to_a_plain_load_and_freeze_their_file_set():
    """``ReadSources``: the reader's tier-only inputs in one value; its default reads everything
    from the location, whose manifest the reader reads itself."""
    plain = ReadSources()
    assert (plain.partial, plain.manifest, plain.checked_files, dict(plain.read_from)) == (False, None, frozenset(), {})
    assert ReadSources(checked_files={"a", "b"}).checked_files == frozenset({"a", "b"})


def test_a_local_disk_hashes_each_piece_before_reading_the_next(runs, monkeypatch):
    """On a local disk a verified task is read a READ_PIECE at a time, each piece hashed before the
    next is read (pieces here straddle hash chunks); a damaged byte still fails the load by name."""
    from goodput_ckpt.format import commit_record
    from goodput_ckpt.storage import direct_read

    loc, manifest = runs
    piece = 48 * KiB  # not a divisor of CHUNK: pieces cross chunk boundaries
    monkeypatch.setattr(reader_mod, "READ_PIECE", piece)
    events: dict[str, list[tuple[str, int]]] = {}

    def log(what: str, n: int) -> None:
        events.setdefault(threading.current_thread().name, []).append((what, n))

    read_into, real_blake3 = direct_read.DirectSource.read_into, commit_record.blake3

    def spy_read(self, offset, buffers):
        log("read", sum(memoryview(b).nbytes for b in buffers))
        return read_into(self, offset, buffers)

    class Hasher:
        def __init__(self) -> None:
            self.h = real_blake3.blake3()

        def update(self, data) -> None:
            log("hash", memoryview(data).nbytes)
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    monkeypatch.setattr(direct_read.DirectSource, "read_into", spy_read)
    monkeypatch.setattr(commit_record, "blake3", type("B3", (), {"blake3": Hasher}))
    dest = zeros_like(_state())
    dcp.load(dest, storage_reader=CheckpointReader(loc, volume=False, thread_count=2))
    assert all(torch.equal(dest[k], v) for k, v in _state().items())
    reads = [n for evs in events.values() for what, n in evs if what == "read"]
    assert max(reads) <= piece and sum(reads) == sum(f.size for f in manifest.files.values())
    for evs in events.values():  # each read is hashed before the thread reads again
        kinds = [what for what, _ in evs]
        assert all(a != "read" or b == "hash" for a, b in zip(kinds, kinds[1:])), kinds
    name = sorted(manifest.files)[2]
    at = 2 * TASK + piece + 5
    data = bytearray((loc / name).read_bytes())
    data[at] ^= 0x10
    (loc / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like(_state()), storage_reader=CheckpointReader(loc, volume=False))
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and name in str(err), info.value
    assert err.byte_range[0] <= at < err.byte_range[1], (err.byte_range, at)
