"""Corruption of a committed checkpoint on disk: flipped bytes, truncated, extended and missing
data files, missing and garbled manifests, and saving over a committed checkpoint.

Everything here works on real files written by dcp.save; nothing is mocked. Errors are checked
twice: through ``dcp.load`` (which wraps them in torch's ``CheckpointException``) and by driving
``CheckpointReader`` directly (``read_metadata``/``read_data`` as DCP calls them), which sees
them unwrapped.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.samples import item_range as sample_item_range
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from goodput_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReader,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME

CHUNK = 4096  # small hash chunks, so byte ranges in errors are precise and a file has several


def _state() -> dict:
    """Not :func:`helpers.make_state`: the damage cases below aim at places in this exact layout
    (hash-chunk boundaries, padding after odd sizes)."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3000, generator=g),  # 12000 bytes: spans three hash chunks
        "b": torch.arange(15, dtype=torch.int64).reshape(3, 5),  # 120 bytes, then padding
        "h": torch.randn(40, 7, generator=g).to(torch.bfloat16),
        "flags": torch.rand(33, generator=g) > 0.5,  # 33 bytes, then padding
        "step": "step-1234",  # a non-tensor value: an object item
    }


def _blank(sd: dict) -> dict:
    """A load destination: every tensor filled with a sentinel, every object None."""
    return {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def _equal(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())


class Ckpt:
    """A committed checkpoint on disk and what it should hold."""

    def __init__(self, path: str, sd: dict) -> None:
        self.path = path
        self.sd = sd
        with open(os.path.join(path, MANIFEST_NAME)) as f:
            self.manifest = json.load(f)
        (self.file,) = self.manifest["files"]  # one rank, one data file
        self.file_path = os.path.join(path, self.file)
        self.size = self.manifest["files"][self.file]["size"]

    def item_range(self, key: str) -> tuple[int, int]:
        _, offset, length = sample_item_range(self.path, key)  # the helper expands a v2 grid
        return offset, offset + length

    def gaps(self) -> list[tuple[int, int]]:
        """Byte ranges of the data file that belong to no item (alignment padding)."""
        spans = sorted(self.item_range(k) for k in self.manifest["items"])
        return [(a[1], b[0]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]

    def keys_at(self, lo: int, hi: int) -> set[str]:
        return {k for k in self.manifest["items"] if self.item_range(k)[0] < hi and lo < self.item_range(k)[1]}

    def chunk_range(self, pos: int) -> tuple[int, int]:
        lo = pos // CHUNK * CHUNK
        return lo, min(self.size, lo + CHUNK)


@pytest.fixture
def ckpt(tmp_path) -> Ckpt:
    path = str(tmp_path / "ckpt")
    sd = _state()
    dcp.save(sd, storage_writer=CheckpointWriter(path, chunk_size=CHUNK))
    return Ckpt(path, sd)


def flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 0xFF]))


def dcp_load_error(path: str, dest: dict, **reader_kw) -> CheckpointError:
    """dcp.load must fail; return our error from inside torch's CheckpointException."""
    with pytest.raises(CheckpointException) as info:
        dcp.load(dest, storage_reader=CheckpointReader(path, **reader_kw))
    err = find_checkpoint_error(info.value)
    assert err is not None, f"no CheckpointError inside {info.value!r}"
    return err


def direct_load(path: str, dest: dict, between=None, **reader_kw) -> None:
    """Load the way dcp.load drives a reader on one rank, without its exception wrapper.
    ``between`` runs after the manifest is read and before any data is (a race with a deleter)."""
    reader = CheckpointReader(path, **reader_kw)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, md, True)
    reader.set_up_storage_reader(md, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    plan = planner.finish_plan(plan)
    if between is not None:
        between()
    reader.read_data(plan, planner).wait()


def dcp_metadata_failure(path: str, dest: dict) -> CheckpointException:
    """dcp.load of a location whose manifest cannot be read.

    torch 2.13 replaces an exception from ``read_metadata`` by ``AssertionError("metadata is
    None; global metadata read failed: <message>")``: the type is lost, the message survives.
    Callers that need the type call ``CheckpointReader(path).read_metadata()`` first.
    """
    with pytest.raises(CheckpointException) as info:
        dcp.load(dest, storage_reader=CheckpointReader(path))
    return info.value


def assert_corrupt(err: CheckpointError, ckpt: Ckpt, pos: int, key: str | None) -> None:
    lo, hi = ckpt.chunk_range(pos)
    assert type(err) is CorruptCheckpointError, repr(err)
    assert err.path is not None and os.path.samefile(err.path, ckpt.file_path)
    assert err.byte_range == (lo, hi)
    keys = set(err.key.split(", ")) if err.key else set()
    assert keys == ckpt.keys_at(lo, hi)
    if key is not None:
        assert key in keys
    msg = str(err)
    assert ckpt.file in msg and f"[{lo}, {hi})" in msg
    for k in keys:
        assert repr(k) in msg or k in msg


# -- one flipped byte --------------------------------------------------------------------------

_TARGETS = {  # where in an item to flip: fraction of its length
    "w-first": ("w", 0.0),
    "w-middle": ("w", 0.5),  # the middle hash chunk of w
    "w-last": ("w", 0.9999),
    "b": ("b", 0.5),
    "h": ("h", 0.3),
    "flags": ("flags", 0.99),
    "step": ("step", 0.5),
}


@pytest.mark.parametrize("target", sorted(_TARGETS))
@pytest.mark.parametrize("via", ["dcp.load", "reader"])
def test_flipped_byte_is_named(ckpt, target, via):
    key, frac = _TARGETS[target]
    lo, hi = ckpt.item_range(key)
    pos = lo + int((hi - lo - 1) * frac)
    flip(ckpt.file_path, pos)
    dest = _blank(ckpt.sd)
    if via == "dcp.load":
        err = dcp_load_error(ckpt.path, dest)
    else:
        with pytest.raises(CorruptCheckpointError) as info:
            direct_load(ckpt.path, dest)
        err = info.value
    assert_corrupt(err, ckpt, pos, key)
    assert "checksum mismatch" in str(err)


def test_every_flipped_byte_is_caught(ckpt):
    """Flip bytes all over the file, padding included: a verified load never succeeds. The
    control load with verify=False shows the flip really changed the data it hit."""
    rng = random.Random(20)
    positions = sorted({0, ckpt.size - 1, *(rng.randrange(ckpt.size) for _ in range(30))})
    in_data = 0
    for pos in positions:
        flip(ckpt.file_path, pos)
        err = dcp_load_error(ckpt.path, _blank(ckpt.sd))
        assert_corrupt(err, ckpt, pos, None)
        unverified = _blank(ckpt.sd)
        if ckpt.keys_at(pos, pos + 1) - {"step"}:  # a flipped object byte may not even decode
            dcp.load(unverified, storage_reader=CheckpointReader(ckpt.path, verify=False))
            assert not _equal(unverified, ckpt.sd)
            in_data += 1
        flip(ckpt.file_path, pos)  # restore
    assert in_data >= 10
    fresh = _blank(ckpt.sd)
    dcp.load(fresh, storage_reader=CheckpointReader(ckpt.path))
    assert _equal(fresh, ckpt.sd)


def test_corrupt_values_never_returned(ckpt):
    """With verify=True the flipped value is never handed back: the load raises, and loading the
    same key again with the same reader keeps raising (nothing half-read is cached)."""
    w_lo, _ = ckpt.item_range("w")
    flip(ckpt.file_path, w_lo + 2)  # in the first hash chunk, which holds only w
    reader = CheckpointReader(ckpt.path)
    for _ in range(2):
        with pytest.raises(CheckpointException) as info:
            dcp.load({"w": torch.zeros(3000)}, storage_reader=reader)
        assert type(find_checkpoint_error(info.value)) is CorruptCheckpointError
    # Keys whose hash chunks are intact still load: verification is per chunk read.
    others = {k: v for k, v in ckpt.sd.items() if k != "w"}
    assert all(ckpt.chunk_range(ckpt.item_range(k)[0])[0] > 0 for k in others)
    dest = _blank(others)
    dcp.load(dest, storage_reader=CheckpointReader(ckpt.path))
    assert _equal(dest, others)


def test_flipped_padding_byte_is_caught(ckpt):
    gaps = ckpt.gaps()
    assert gaps, "the layout has no padding between items"
    with open(ckpt.file_path, "rb") as f:
        data = f.read()
    assert all(data[a:b] == bytes(b - a) for a, b in gaps), "padding must be zero bytes"
    for a, b in gaps:
        pos = (a + b) // 2
        flip(ckpt.file_path, pos)
        err = dcp_load_error(ckpt.path, _blank(ckpt.sd))
        assert_corrupt(err, ckpt, pos, None)
        with pytest.raises(CorruptCheckpointError):
            direct_load(ckpt.path, _blank(ckpt.sd))
        # Padding is not data: unverified, the values are exactly right.
        dest = _blank(ckpt.sd)
        dcp.load(dest, storage_reader=CheckpointReader(ckpt.path, verify=False))
        assert _equal(dest, ckpt.sd)
        flip(ckpt.file_path, pos)


# -- truncated, extended, missing data files ---------------------------------------------------


@pytest.mark.parametrize("new_size", ["empty", "one byte", "half", "minus one"])
def test_truncated_data_file(ckpt, new_size):
    size = {"empty": 0, "one byte": 1, "half": ckpt.size // 2, "minus one": ckpt.size - 1}[new_size]
    os.truncate(ckpt.file_path, size)
    with pytest.raises(CorruptCheckpointError) as info:
        CheckpointReader(ckpt.path).read_metadata()
    err = info.value
    assert os.path.samefile(err.path, ckpt.file_path) and err.byte_range == (size, ckpt.size)
    assert set(err.key.split(", ")) == ckpt.keys_at(size, ckpt.size)
    assert "truncated" in str(err) and ckpt.file in str(err)
    exc = dcp_metadata_failure(ckpt.path, _blank(ckpt.sd))
    assert str(err) in str(exc)


def test_extended_data_file(ckpt):
    with open(ckpt.file_path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCheckpointError, match="extended") as info:
        CheckpointReader(ckpt.path).read_metadata()
    assert info.value.byte_range == (ckpt.size, ckpt.size + 1)


def test_truncated_while_loading(ckpt):
    """Truncated after the manifest was checked, before the data is read: still a clean error
    naming the range, not a short read handed back as data."""
    cut = ckpt.item_range("h")[0] + 10
    dest = _blank(ckpt.sd)
    with pytest.raises(CorruptCheckpointError) as info:
        direct_load(ckpt.path, dest, between=lambda: os.truncate(ckpt.file_path, cut))
    err = info.value
    assert os.path.samefile(err.path, ckpt.file_path)
    lo, hi = err.byte_range
    assert lo <= cut < hi and "truncated" in str(err) and err.key


def test_missing_data_file(ckpt):
    os.remove(ckpt.file_path)
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        CheckpointReader(ckpt.path).read_metadata()
    err = info.value
    assert err.path == ckpt.file_path and set(err.key.split(", ")) == set(ckpt.sd)
    assert str(err) in str(dcp_metadata_failure(ckpt.path, _blank(ckpt.sd)))


def test_missing_while_loading(ckpt):
    dest = _blank(ckpt.sd)
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        direct_load(ckpt.path, dest, between=lambda: os.remove(ckpt.file_path))
    assert info.value.path == ckpt.file_path and info.value.key


# -- the manifest ------------------------------------------------------------------------------


def test_missing_manifest_with_data_is_incomplete(ckpt):
    os.remove(os.path.join(ckpt.path, MANIFEST_NAME))
    reader = CheckpointReader(ckpt.path)
    for call in (reader.read_metadata, lambda: reader.manifest):
        with pytest.raises(IncompleteCheckpointError, match="no manifest.json") as info:
            call()
        assert info.value.path == ckpt.path
    assert "IncompleteCheckpointError" not in str(info.value)
    assert str(info.value) in str(dcp_metadata_failure(ckpt.path, _blank(ckpt.sd)))


@pytest.mark.parametrize("kind", ["empty dir", "no dir", "uri"])
def test_nothing_there_is_not_found(tmp_path, kind):
    path = tmp_path / "nothing"
    if kind == "empty dir":
        path.mkdir()
    uri = f"file://{path}" if kind == "uri" else str(path)
    with pytest.raises(CheckpointNotFoundError) as info:
        CheckpointReader(uri).read_metadata()
    assert os.path.abspath(info.value.path) == str(path)
    assert str(info.value) in str(dcp_metadata_failure(uri, {"x": torch.zeros(1)}))
    assert not os.path.exists(path) or not os.listdir(path)  # a failed load creates nothing


def test_location_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        CheckpointReader(str(path)).read_metadata()


def _garbled(raw: bytes) -> dict[str, bytes]:
    rng = random.Random(7)
    return {
        "empty": b"",
        "truncated 1": raw[:1],
        "truncated half": raw[: len(raw) // 2],
        "truncated minus 1": raw[:-1],
        "random bytes": bytes(rng.randrange(256) for _ in range(600)),
        "random printable": "".join(rng.choice('{}[]":,0123456789abc ') for _ in range(600)).encode(),
        "nul bytes": bytes(len(raw)),
        "bom": b"\xef\xbb\xbf" + raw,
        "json null": b"null",
        "json list": b"[]",
        "json string": b'"goodput-ckpt"',
        "json empty object": b"{}",
        "only the header": b'{"format": "goodput-ckpt", "version": 1}',
        "files is a list": raw.replace(b'"files":{', b'"files":[{', 1).replace(b'}},"items"', b'}}],"items"', 1),
        "items is null": raw[: raw.index(b'"items":')] + b'"items":null,' + raw[raw.index(b'"dcp":') :],
        "deep nesting": b"[" * 100_000 + b"]" * 100_000,
        "huge integer": raw.replace(b'"world_size":1', b'"world_size":' + b"1" * 5000, 1),
    }


@pytest.mark.parametrize("name", sorted(_garbled(b'{"files":{"a":{}},"items":{},"dcp":{}}')))
def test_garbled_manifest(ckpt, name):
    with open(os.path.join(ckpt.path, MANIFEST_NAME), "rb") as f:
        raw = f.read()
    bad = _garbled(raw)[name]
    assert bad != raw
    with open(os.path.join(ckpt.path, MANIFEST_NAME), "wb") as f:
        f.write(bad)
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(ckpt.path).read_metadata()
    err = info.value
    assert type(err) is CorruptCheckpointError, repr(err)
    assert err.path == os.path.join(ckpt.path, MANIFEST_NAME) and MANIFEST_NAME in str(err)
    assert str(err) in str(dcp_metadata_failure(ckpt.path, _blank(ckpt.sd)))


# -- saving over a committed checkpoint -------------------------------------------------------


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def test_save_over_committed_checkpoint_is_refused(ckpt):
    before = _files(ckpt.path)
    new = {"w": torch.zeros(10)}
    with pytest.raises(CheckpointException) as info:
        dcp.save(new, storage_writer=CheckpointWriter(ckpt.path))
    err = find_checkpoint_error(info.value)
    assert type(err) is CheckpointExistsError and "overwrite=True" in str(err)
    assert os.path.abspath(err.path) == ckpt.path
    assert _files(ckpt.path) == before  # not a byte changed, no stray file
    dest = _blank(ckpt.sd)
    dcp.load(dest, storage_reader=CheckpointReader(ckpt.path))
    assert _equal(dest, ckpt.sd)


def test_overwrite_replaces_checkpoint(ckpt):
    new = {"w": torch.arange(5000.0), "step": 9}
    dcp.save(new, storage_writer=CheckpointWriter(ckpt.path, overwrite=True))
    names = os.listdir(ckpt.path)
    assert ckpt.file not in names and MANIFEST_NAME in names and len(names) == 2
    dest = {"w": torch.zeros(5000), "step": None}
    dcp.load(dest, storage_reader=CheckpointReader(ckpt.path))
    assert torch.equal(dest["w"], new["w"]) and dest["step"] == 9
    with pytest.raises(CheckpointException):  # the old keys are gone with the old checkpoint
        dcp.load({"b": torch.zeros(3, 5, dtype=torch.int64)}, storage_reader=CheckpointReader(ckpt.path))


_FAILING_OVERWRITE = textwrap.dedent(
    """
    import resource, signal, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from goodput_ckpt import CheckpointWriter
    from goodput_ckpt.errors import find_checkpoint_error
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        dcp.save({"big": torch.ones(1 << 20)}, storage_writer=CheckpointWriter(sys.argv[1], overwrite=True))
    except CheckpointException as e:
        err = find_checkpoint_error(e)
        print(type(err).__name__, err)
        sys.exit(0 if err is not None else 3)
    sys.exit(2)
    """
)


def test_failed_overwrite_never_leaves_old_manifest(ckpt):
    """An overwrite that fails while writing data (here: the file-size limit, EFBIG) must have
    removed the old manifest first: the location is then visibly incomplete, never the old
    manifest beside new data, and the failed save leaves no manifest of its own."""
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_OVERWRITE, ckpt.path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("CheckpointError") and "file-size limit" in proc.stdout, proc.stdout
    assert not os.path.exists(os.path.join(ckpt.path, MANIFEST_NAME))
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        CheckpointReader(ckpt.path).read_metadata()
    # The next save to the location needs no overwrite, and cleans up what was left.
    dcp.save({"w": torch.ones(4)}, storage_writer=CheckpointWriter(ckpt.path))
    assert len(os.listdir(ckpt.path)) == 2
