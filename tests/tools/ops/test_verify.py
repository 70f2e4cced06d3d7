"""verify_checkpoint on good, corrupt (flipped byte, truncated, missing file, bad manifest) and
incomplete checkpoints: every problem is reported, with its file, byte range and keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.samples import CHUNK, damaged_manifests, flip_byte, item_range, manifest, rewrite_manifest, save, truncate

from goodput_ckpt import CheckpointNotFoundError, CheckpointReader, CorruptCheckpointError, IncompleteCheckpointError
from goodput_ckpt.format import MANIFEST_NAME
from goodput_ckpt.tools.ops.verify import verify_checkpoint


def test_good_checkpoint_hashes_every_byte(sample_ckpt):
    path, _ = sample_ckpt
    r = verify_checkpoint(str(path))
    m = manifest(path)
    total = sum(f["size"] for f in m["files"].values())
    assert r.ok and r.status == "ok" and not r.problems and not r.warnings
    assert r.version == 2 and r.world_size == 1 and r.files == len(m["files"])
    assert r.bytes_hashed == r.bytes_total == total
    assert r.chunks_checked == sum(len(f["chunks"]) for f in m["files"].values()) > 10


def test_flipped_bytes_in_two_places_are_both_reported(ckpt):
    f1, off1, n1 = item_range(ckpt, "model.embed.weight")
    f2, off2, _ = item_range(ckpt, "optimizer.state.embed.weight.exp_avg")
    at1 = off1 + n1 // 2
    flip_byte(ckpt, f1, at1)
    flip_byte(ckpt, f2, off2 + 3)
    r = verify_checkpoint(str(ckpt), thread_count=3)
    assert r.status == "corrupt" and not r.ok
    kinds = [p.kind for p in r.problems]
    assert kinds == ["checksum", "checksum"], r.problems
    first = next(p for p in r.problems if p.byte_range[0] <= at1 < p.byte_range[1])
    assert first.file == f1 and first.byte_range == (at1 // CHUNK * CHUNK, at1 // CHUNK * CHUNK + CHUNK)
    assert first.keys == ["model.embed.weight"]
    second = next(p for p in r.problems if p is not first)
    assert "optimizer.state.embed.weight.exp_avg" in second.keys
    assert "checksum mismatch" in second.message and second.file in second.message


def test_adjacent_bad_chunks_are_one_problem(ckpt):
    f, off, n = item_range(ckpt, "model.embed.weight")
    for at in range(off, off + n, CHUNK // 2):
        flip_byte(ckpt, f, at)
    r = verify_checkpoint(str(ckpt))
    assert len(r.problems) == 1
    lo, hi = r.problems[0].byte_range
    assert lo <= off and hi >= off + n - CHUNK
    assert "chunks" in r.problems[0].message


def test_truncated_file_reports_the_range_and_still_hashes_the_rest(ckpt):
    f, off, n = item_range(ckpt, "model.embed.weight")
    size = manifest(ckpt)["files"][f]["size"]
    cut = size - 1000
    truncate(ckpt, f, cut)
    flip_byte(ckpt, f, off + 10)  # damage before the cut must be found as well
    r = verify_checkpoint(str(ckpt))
    by_kind = {p.kind: p for p in r.problems}
    assert set(by_kind) == {"size", "checksum"}
    assert by_kind["size"].byte_range == (cut, size) and "truncated" in by_kind["size"].message
    assert by_kind["size"].keys  # the last item(s) of the file
    assert by_kind["checksum"].keys == ["model.embed.weight"]


def test_quick_checks_sizes_not_hashes(ckpt):
    f, off, _ = item_range(ckpt, "model.embed.weight")
    flip_byte(ckpt, f, off)
    assert verify_checkpoint(str(ckpt), quick=True).ok
    r = verify_checkpoint(str(ckpt), quick=True)
    assert r.bytes_hashed == 0 and r.quick
    truncate(ckpt, f, 100)
    r = verify_checkpoint(str(ckpt), quick=True)
    assert [p.kind for p in r.problems] == ["size"]


def test_missing_data_file(ckpt):
    f, _, _ = item_range(ckpt, "model.embed.weight")
    (ckpt / f).unlink()
    r = verify_checkpoint(str(ckpt))
    assert [p.kind for p in r.problems] == ["missing"]
    assert "model.embed.weight" in r.problems[0].keys and r.problems[0].file == f


def test_incomplete_not_found_and_file(ckpt, tmp_path):
    (ckpt / MANIFEST_NAME).unlink()
    r = verify_checkpoint(str(ckpt))
    assert r.status == "incomplete" and r.problems[0].kind == "incomplete"
    assert "never committed" in r.problems[0].message
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "a.pt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        verify_checkpoint(str(tmp_path / "a.pt"))


def test_garbled_and_hostile_manifests(ckpt):
    good = (ckpt / MANIFEST_NAME).read_bytes()
    (ckpt / MANIFEST_NAME).write_bytes(good[: len(good) // 2])
    r = verify_checkpoint(str(ckpt))
    assert r.status == "corrupt" and r.problems[0].kind == "manifest"
    doc = json.loads(good)
    name = next(iter(doc["files"]))
    doc["files"]["../escape.bin"] = doc["files"].pop(name)
    rewrite_manifest(ckpt, doc)
    r = verify_checkpoint(str(ckpt))
    assert r.status == "corrupt" and ".." in r.problems[0].message
    doc = json.loads(good)
    doc["version"] = 99
    rewrite_manifest(ckpt, doc)
    r = verify_checkpoint(str(ckpt))
    assert r.status == "unsupported" and r.version == 99 and "99" in r.problems[0].message
    doc = json.loads(good)
    doc["world_size"] = 3  # an edit that keeps the JSON valid breaks the manifest's own digest
    (ckpt / MANIFEST_NAME).write_text(json.dumps(doc))
    r = verify_checkpoint(str(ckpt))
    assert r.status == "corrupt" and r.problems[0].kind == "manifest"


@pytest.mark.parametrize("damage", ["truncated", "digest", "garbage"])
def test_invalid_manifest_is_corrupt_on_disk_and_incomplete_on_a_volume(ckpt, damage):
    """Local disk commits the manifest by link/replace, so an invalid one (its own digest
    included) was damaged: corrupt. In volume mode the manifest is written in place, so an
    invalid one may be half written: incomplete. verify and the reader agree on both."""
    (ckpt / MANIFEST_NAME).write_bytes(damaged_manifests((ckpt / MANIFEST_NAME).read_bytes())[damage])
    r = verify_checkpoint(str(ckpt))
    assert r.status == "corrupt" and [p.kind for p in r.problems] == ["manifest"], r.problems
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(str(ckpt)).read_metadata()
    if damage == "digest":
        assert "fails its own checksum" in r.problems[0].message
    r = verify_checkpoint(str(ckpt), volume=True)
    assert r.status == "incomplete" and [p.kind for p in r.problems] == ["incomplete"], r.problems
    assert "mounted volume" in r.problems[0].message and r.problems[0].file == MANIFEST_NAME
    with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
        CheckpointReader(str(ckpt), volume=True).read_metadata()


def test_extra_file_is_a_warning_only(ckpt):
    (ckpt / "rank00000-00.ffffffffffff.bin").write_bytes(b"leftover")
    r = verify_checkpoint(str(ckpt))
    assert r.ok and [w.kind for w in r.warnings] == ["extra"]


@pytest.mark.parametrize("threads", [1, 8])
def test_many_files_and_thread_counts_agree(tmp_path, threads):
    path = tmp_path / "c"
    save(path, files_per_rank=3)
    f, off, _ = item_range(path, "optimizer.state.embed.weight.exp_avg")
    flip_byte(path, f, off + CHUNK + 5)
    r = verify_checkpoint(str(path), thread_count=threads)
    assert r.files == 3 and len(r.problems) == 1 and r.problems[0].file == f
    assert r.chunks_checked == sum(len(x["chunks"]) for x in manifest(path)["files"].values())


def test_verify_needs_no_torch(sample_ckpt):
    """verify is a storage + manifest check: it runs with torch blocked."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, Block())
        from goodput_ckpt.tools import verify_checkpoint, inspect_checkpoint, list_checkpoints
        assert verify_checkpoint({str(sample_ckpt[0])!r}).ok
        assert inspect_checkpoint({str(sample_ckpt[0])!r}).tensors > 0
        assert list_checkpoints({str(Path(sample_ckpt[0]).parent)!r}).checkpoints[0].status == "complete"
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _one_chunk_checkpoint(root: Path, data: bytes) -> str:
    """A checkpoint of one object item over ``data``, hashed with the largest legal chunk (1 GiB)."""
    import blake3

    from goodput_ckpt.format.manifest import MAX_CHUNK_SIZE, FileEntry, Manifest, ObjectEntry

    root.mkdir()
    (root / "f.bin").write_bytes(data)
    m = Manifest(
        version=1,
        library_version="t",
        torch_version="t",
        created_at="t",
        world_size=1,
        chunk_size=MAX_CHUNK_SIZE,
        files={"f.bin": FileEntry("f.bin", len(data), (blake3.blake3(data).hexdigest(),))},
        items={"obj": ObjectEntry("obj", "torch.save", "f.bin", 0, len(data))},
    )
    (root / MANIFEST_NAME).write_bytes(m.to_json())
    return str(root)


def _verify_peak(path: str, threads: int = 8):
    import tracemalloc

    tracemalloc.start()
    try:
        report = verify_checkpoint(path, thread_count=threads)
        return report, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_buffers_are_bounded_by_the_file_not_the_chunk_size(tmp_path):
    """A 1 KiB checkpoint hashed in 1 GiB chunks: verify allocated a chunk-sized buffer per
    worker (issue 16 item 5); a buffer now holds no more than the bytes its task reads."""
    report, peak = _verify_peak(_one_chunk_checkpoint(tmp_path / "small", bytes(range(256)) * 4))
    assert report.ok and report.chunks_checked == 1
    assert peak < 4 << 20, f"verify allocated {peak} bytes for a 1 KiB checkpoint"


def test_a_chunk_larger_than_a_task_is_read_and_hashed_in_pieces(tmp_path):
    """A file larger than TASK_BYTES in one 1 GiB chunk: read in TASK_BYTES pieces (memory stays
    at one task's buffer), and a flipped byte in the last piece is still found."""
    from goodput_ckpt.tools.ops.verify import TASK_BYTES

    data = bytearray(TASK_BYTES + (1 << 20) + 17)
    path = _one_chunk_checkpoint(tmp_path / "big", bytes(data))
    report, peak = _verify_peak(path)
    assert report.ok and report.bytes_hashed == len(data)
    assert peak < TASK_BYTES + (4 << 20), f"verify allocated {peak} bytes"
    flip_byte(path, "f.bin", len(data) - 5)
    report, _ = _verify_peak(path)
    assert report.status == "corrupt" and [p.kind for p in report.problems] == ["checksum"]
    assert report.problems[0].byte_range == (0, len(data)) and report.problems[0].keys == ["obj"]
