"""Hostile manifests: every one must be refused with a clean CheckpointError, before any data read.

The corpus lives in ``hostile/`` (regenerate with ``hostile/make_corpus.py``); ``expected.json``
there says which error each file must raise. Besides the corpus, this module builds hostile
checkpoints from real saves: an object item whose bytes are a code-executing pickle, a manifest
copied in from another checkpoint, and manifests with one digit changed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import zipfile

import blake3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.trees import make_state, zeros_like
from torch.distributed.checkpoint.api import CheckpointException

import goodput_ckpt.errors as errors
from goodput_ckpt import CheckpointError, CheckpointReader, CheckpointWriter
from goodput_ckpt.errors import CorruptCheckpointError, find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest, seal_manifest

HOSTILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile")
with open(os.path.join(HOSTILE, "expected.json")) as _f:
    _EXPECTED = json.load(_f)
CASES = _EXPECTED["cases"]
DATA_FILES = _EXPECTED["data_files"]


def _error_class(name: str) -> type[CheckpointError]:
    cls = getattr(errors, name)
    assert issubclass(cls, CheckpointError)
    return cls


def _make_location(root, manifest: bytes) -> str:
    """The corpus's data files (zeros, as every manifest there describes) plus ``manifest``."""
    os.makedirs(root)
    for name, size in DATA_FILES.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(bytes(size))
    with open(os.path.join(root, MANIFEST_NAME), "wb") as f:
        f.write(manifest)
    return str(root)


def _read(name: str) -> bytes:
    with open(os.path.join(HOSTILE, name), "rb") as f:
        return f.read()


def assert_reports(exc: CheckpointException, err: CheckpointError) -> None:
    """``exc`` (from dcp.load) reports ``err``. torch 2.13 turns an exception from
    ``read_metadata`` into ``AssertionError(f"metadata is None; ... failed: {err}")``, dropping
    its type, so for manifest errors only the message survives the wrapper."""
    inner = find_checkpoint_error(exc)
    if inner is not None:
        assert type(inner) is type(err) and str(inner) == str(err), exc
    else:
        assert str(err) in str(exc), exc


def _raises_clean(fn, cls: type[CheckpointError], fragment: str) -> CheckpointError:
    """Call ``fn``; it must raise exactly ``cls`` (anything else fails the test) naming ``fragment``."""
    with pytest.raises(CheckpointError) as info:
        fn()
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert fragment in str(err), f"{fragment!r} not in the message: {err}"
    return err


# -- the corpus ------------------------------------------------------------------------------


def test_corpus_is_complete():
    on_disk = {n for n in os.listdir(HOSTILE) if n.endswith(".json")} - {"expected.json", "valid.json"}
    assert on_disk == set(CASES), "run hostile/make_corpus.py: the corpus and expected.json disagree"
    assert len(CASES) >= 60


def test_valid_base_is_accepted(tmp_path):
    """The control: the unmodified base parses, and beside its data files it loads and verifies."""
    raw = _read("valid.json")
    m = parse_manifest(raw)
    assert set(m.items) == {"w", "step", "b"}
    loc = _make_location(tmp_path / "valid", raw)
    CheckpointReader(loc).read_metadata()
    sd = {"w": torch.ones(16, 128), "b": torch.ones(4, dtype=torch.int64)}
    dcp.load(sd, storage_reader=CheckpointReader(loc))
    assert not sd["w"].any() and not sd["b"].any()


@pytest.mark.parametrize(
    "boxes",
    [
        [([0, 0], [8, 128]), ([8, 0], [8, 128])],  # row shards
        [([0, 0], [16, 64]), ([0, 64], [16, 64])],  # column shards
        [([8, 64], [8, 64]), ([0, 0], [8, 64]), ([8, 0], [8, 64]), ([0, 64], [8, 64])],  # a 2x2 grid
        [([0, 0], [16, 128]), ([16, 0], [0, 128])],  # plus an empty shard (uneven sharding)
    ],
)
def test_sharded_tensor_tiling_is_accepted(tmp_path, boxes):
    """The tiling check refuses gaps and overlaps (corpus), not real shardings."""
    doc = json.loads(_read("valid.json"))
    chunks, offset = [], 0
    for offsets, sizes in boxes:
        length = sizes[0] * sizes[1] * 4
        chunks.append(
            {
                "offsets": offsets,
                "sizes": sizes,
                "file": "rank00000-00.0123456789ab.bin",
                "offset": offset,
                "length": length,
            }
        )
        offset += length
    doc["items"]["w"]["chunks"] = chunks
    raw = seal_manifest(json.dumps(doc).encode())
    assert len(parse_manifest(raw).items["w"].chunks) == len(boxes)
    sd = {"w": torch.ones(16, 128), "b": torch.ones(4, dtype=torch.int64)}
    dcp.load(sd, storage_reader=CheckpointReader(_make_location(tmp_path / "ckpt", raw)))
    assert not sd["w"].any()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_manifest_parse(name):
    case = CASES[name]
    raw = _read(name)
    if case["parse"] is None:
        parse_manifest(raw)  # consistent on its own; refused against the files (next test)
        return
    err = _raises_clean(lambda: parse_manifest(raw, location="/ckpt"), _error_class(case["parse"]), case["message"])
    if name.startswith("version_") and name != "version_huge_int.json":
        assert err.version == json.loads(raw).get("version")


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_manifest_read_metadata(name, tmp_path):
    case = CASES[name]
    loc = _make_location(tmp_path / "ckpt", _read(name))
    before = sorted(os.listdir(tmp_path))
    cls = _error_class(case["read_metadata"])
    err = _raises_clean(lambda: CheckpointReader(loc).read_metadata(), cls, case["message"])
    assert err.path is None or isinstance(err.path, str)
    # ...and through dcp.load, which refuses it too, with our message, before reading any data.
    sd = {"w": torch.ones(16, 128), "b": torch.ones(4, dtype=torch.int64)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=CheckpointReader(loc))
    assert_reports(info.value, err)
    assert sd["w"].all() and sd["b"].all()
    assert sorted(os.listdir(tmp_path)) == before  # nothing created outside the location


def test_dotdot_path_never_reads_outside(tmp_path):
    """A manifest pointing '../secret.bin' at a real file beside the checkpoint, with correct
    size and digests, is still refused: the file is never opened."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(8256))
    doc = json.loads(_read("valid.json"))
    doc["files"]["../secret.bin"] = doc["files"].pop("rank00000-00.0123456789ab.bin")
    doc["items"]["w"]["chunks"][0]["file"] = "../secret.bin"
    doc["items"]["step"]["file"] = "../secret.bin"
    loc = _make_location(tmp_path / "ckpt", seal_manifest(json.dumps(doc).encode()))
    atime = os.stat(secret).st_atime_ns
    fragment = "unsafe file name '../secret.bin'"
    _raises_clean(lambda: CheckpointReader(loc).read_metadata(), CorruptCheckpointError, fragment)
    _raises_clean(
        lambda: parse_manifest(seal_manifest(json.dumps(doc).encode())), CorruptCheckpointError, "'../secret.bin'"
    )
    assert os.stat(secret).st_atime_ns == atime


# -- hostile checkpoints built from real saves ----------------------------------------------


def _rehash(loc: str, doc: dict, file: str) -> None:
    """Make the manifest's size and digests of ``file`` match its current bytes (an attacker
    who can write the checkpoint can do this; integrity checks alone do not stop them)."""
    cs = doc["hash"]["chunk_size"]
    data = open(os.path.join(loc, file), "rb").read()
    doc["files"][file] = {
        "size": len(data),
        "chunks": [blake3.blake3(data[i : i + cs]).hexdigest() for i in range(0, len(data), cs)],
    }
    with open(os.path.join(loc, MANIFEST_NAME), "wb") as f:
        f.write(seal_manifest(json.dumps(doc).encode()))


def _replace_object_bytes(loc: str, key: str, payload: bytes) -> None:
    """Put ``payload`` where ``key``'s bytes are, appended to its file, with a consistent manifest."""
    with open(os.path.join(loc, MANIFEST_NAME)) as f:
        doc = json.load(f)
    item = doc["items"][key]
    path = os.path.join(loc, item["file"])
    size = os.path.getsize(path)
    offset = (size + 63) // 64 * 64
    with open(path, "ab") as f:
        f.write(bytes(offset - size) + payload)
    item["offset"], item["length"] = offset, len(payload)
    _rehash(loc, doc, item["file"])


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _torch_save_archive(payload_pickle: bytes) -> bytes:
    """A real ``torch.save`` zip archive whose ``data.pkl`` is replaced by ``payload_pickle``."""
    buf = io.BytesIO()
    torch.save({"ok": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = payload_pickle if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info, data)
    return out.getvalue()


@pytest.fixture
def object_ckpt(tmp_path):
    loc = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(10.0), "step": "hello"}, storage_writer=CheckpointWriter(loc, chunk_size=4096))
    return loc


@pytest.mark.parametrize("container", ["raw_pickle", "torch_save_zip"])
@pytest.mark.parametrize("verify", [True, False])
def test_code_executing_pickle_is_refused(object_ckpt, tmp_path, container, verify):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Exploit(str(marker)), protocol=2)
    payload = evil if container == "raw_pickle" else _torch_save_archive(evil)
    _replace_object_bytes(object_ckpt, "step", payload)
    CheckpointReader(object_ckpt).read_metadata()  # the manifest itself is consistent
    sd = {"w": torch.zeros(10), "step": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=CheckpointReader(object_ckpt, verify=verify))
    err = find_checkpoint_error(info.value)
    assert type(err) is CheckpointError, info.value
    assert err.key == "step" and "weights_only=True" in str(err) and "trust_pickle=True" in str(err)
    assert not marker.exists(), "the pickle payload ran"
    assert sd["step"] is None


def test_pickle_payload_is_live(object_ckpt, tmp_path):
    """The control for the test above: with the explicit opt-in the same payload does run, so it
    is weights_only (not a broken payload) that stops it."""
    marker = tmp_path / "pwned"
    _replace_object_bytes(object_ckpt, "step", _torch_save_archive(pickle.dumps(_Exploit(str(marker)), protocol=2)))
    dcp.load({"w": torch.zeros(10), "step": None}, storage_reader=CheckpointReader(object_ckpt, trust_pickle=True))
    assert marker.exists()


def _save(loc: str, sd: dict) -> str:
    dcp.save(sd, storage_writer=CheckpointWriter(loc, chunk_size=4096))
    return loc


def _data_files(loc: str) -> list[str]:
    return sorted(n for n in os.listdir(loc) if n.endswith(".bin"))


def test_copied_manifest_names_missing_files(tmp_path):
    a, b = _save(str(tmp_path / "a"), make_state(1)), _save(str(tmp_path / "b"), make_state(2))
    shutil.copy(os.path.join(a, MANIFEST_NAME), os.path.join(b, MANIFEST_NAME))
    (missing,) = _data_files(a)
    err = _raises_clean(lambda: CheckpointReader(b).read_metadata(), CorruptCheckpointError, "is missing")
    assert err.path == os.path.join(b, missing) and "w" in err.key


def test_copied_manifest_same_layout_fails_hash(tmp_path):
    """Same keys and shapes, different values, data files renamed to the names the copied manifest
    expects: sizes agree, so only the digests can tell. A verified load must refuse it."""
    a, b = _save(str(tmp_path / "a"), make_state(1)), _save(str(tmp_path / "b"), make_state(2))
    shutil.copy(os.path.join(a, MANIFEST_NAME), os.path.join(b, MANIFEST_NAME))
    (name_a,), (name_b,) = _data_files(a), _data_files(b)
    os.rename(os.path.join(b, name_b), os.path.join(b, name_a))
    CheckpointReader(b).read_metadata()  # sizes match
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like(make_state(0)), storage_reader=CheckpointReader(b))
    err = find_checkpoint_error(info.value)
    assert type(err) is CorruptCheckpointError and "checksum mismatch" in str(err), info.value
    assert err.path == os.path.join(b, name_a)


def test_copied_manifest_other_layout_fails_size(tmp_path):
    a, b = _save(str(tmp_path / "a"), make_state(1, numel=5000)), _save(str(tmp_path / "b"), make_state(2, numel=7000))
    shutil.copy(os.path.join(a, MANIFEST_NAME), os.path.join(b, MANIFEST_NAME))
    (name_a,), (name_b,) = _data_files(a), _data_files(b)
    os.rename(os.path.join(b, name_b), os.path.join(b, name_a))
    err = _raises_clean(lambda: CheckpointReader(b).read_metadata(), CorruptCheckpointError, "but the manifest records")
    assert err.path == os.path.join(b, name_a) and err.byte_range is not None


# -- manifests with one digit changed ---------------------------------------------------------


def _digit_mutations(raw: str) -> list[tuple[int, str]]:
    """Every (position, new digit) that changes one digit of the JSON by one bit, as a disk or a
    bad copy would; the result stays valid JSON. Digits inside hex digests are left alone."""
    out = []
    for m in re.finditer(r"(?<![0-9a-f])[0-9]", raw):
        old = int(m.group())
        out += [(m.start(), str(old ^ (1 << b))) for b in range(4) if old ^ (1 << b) <= 9]
    return out


def test_one_digit_manifest_changes_never_load_wrong_values(tmp_path):
    """Every digit of a real manifest, changed by one bit: reading must fail with a
    CheckpointError, or fail in DCP's planner (shape mismatch), or load exactly the saved values.
    Never different values, never a non-CheckpointError from our code."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "a": torch.randn(700, generator=g),
        "b": torch.randint(-9, 9, (3, 5), generator=g),
        "c": torch.randn(5, 3, 4, generator=g).to(torch.bfloat16),
        "d": torch.tensor(3.5),
        "step": 17,
    }
    loc = _save(str(tmp_path / "ckpt"), sd)
    manifest_path = os.path.join(loc, MANIFEST_NAME)
    raw = open(manifest_path).read()
    outcomes = {"refused": 0, "dcp": 0, "same": 0}
    mutations = _digit_mutations(raw)
    for pos, digit in mutations:
        mutated = raw[:pos] + digit + raw[pos + 1 :]
        with open(manifest_path, "w") as f:
            f.write(mutated)
        context = mutated[max(0, pos - 120) : pos + 20]
        try:
            CheckpointReader(loc).read_metadata()
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        dest = zeros_like(sd)
        try:
            dcp.load(dest, storage_reader=CheckpointReader(loc))
        except CheckpointException as e:
            if find_checkpoint_error(e) is not None:
                outcomes["refused"] += 1
            else:
                # Only DCP's own planner check may fire outside our errors: the destination's
                # shape differs from the (changed) shape in the manifest.
                assert "Size mismatch" in str(e), (context, e)
                outcomes["dcp"] += 1
            continue
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(dest[k], v), f"silently wrong {k!r} after changing ...{context}..."
            else:
                assert dest[k] == v, context
        outcomes["same"] += 1
    with open(manifest_path, "w") as f:
        f.write(raw)
    assert sum(outcomes.values()) == len(mutations) > 100
    # The manifest's own digest catches every change, including those that stay consistent.
    assert outcomes["refused"] == len(mutations), outcomes
