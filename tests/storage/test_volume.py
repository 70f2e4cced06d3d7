"""CheckpointWriter/CheckpointReader on real FUSE mounts over SeaweedFS.

``rclone_dir`` is on ``rclone mount --vfs-cache-mode off`` (strict object-store semantics, checked
by the fixture: seek-writes fail with ESPIPE, rewrites with EPERM); ``weed_dir`` on ``weed mount``
(permissive); ``volume_dir`` runs a test on both. Nothing here passes ``volume=True``: the writer
and reader detect the mounts themselves, unless a test overrides it on purpose.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _kill import kill_when
from helpers.s3 import ACCESS_KEY, SECRET_KEY
from helpers.trees import assert_tree_equal, make_state, zeros_like
from helpers.volume import RcloneMount
from helpers.wait import wait_until
from torch.distributed.checkpoint.api import CheckpointException

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
from goodput_ckpt.storage import LocalStore, StagedStore, VolumeStore, find_volume, open_store

MiB = 1 << 20
SAVE_WORKER = Path(__file__).resolve().parents[1] / "faults" / "save_worker.py"


def volume_state(seed: int = 0) -> dict:
    """:func:`helpers.make_state` with every awkward value and ``w`` of 12 MB: several 8 MiB chunks."""
    return make_state(seed, numel=3_000_000, awkward=True)


def save(state, path, **kw) -> CheckpointWriter:
    writer = CheckpointWriter(path, **kw)
    dcp.save(state, storage_writer=writer)
    return writer


def load(state, path, **kw) -> dict:
    dest = zeros_like(state)
    dcp.load(dest, storage_reader=CheckpointReader(path, **kw))
    return dest


def data_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".bin"))


def rewrite(path: Path, data: bytes) -> None:
    """Replace a file's content the only way a strict mount allows: create it anew."""
    with open(path, "wb") as f:
        f.write(data)


# -- detection ------------------------------------------------------------------------------------
def test_mounts_are_detected_and_the_option_overrides(rclone_volume, weed_volume, tmp_path):
    for vol, fstype in ((rclone_volume, "fuse.rclone"), (weed_volume, "fuse.seaweedfs")):
        loc = vol.fresh()
        why = find_volume(loc)
        assert why is not None and fstype in why, why
        assert type(open_store(loc)) is VolumeStore
        assert type(open_store(f"file://{loc}")) is VolumeStore
        assert type(open_store(loc, {"volume": False})) is LocalStore
        assert type(CheckpointWriter(loc).store) is VolumeStore
        assert type(CheckpointReader(loc).store) is VolumeStore
        assert type(CheckpointWriter(loc, stage_dir=tmp_path / "st").store) is StagedStore
    assert find_volume(tmp_path) is None


def test_local_mode_forced_onto_a_strict_mount_fails_cleanly(rclone_dir, weed_dir):
    """``volume=False`` is the user's call: on the strict mount the local-disk store fails with
    a CheckpointError (its parallel writes at offsets get ESPIPE, with a hint to use
    volume=True, or, when rclone managed to reorder them, its commit by link or rename fails)
    and leaves no manifest; on the permissive mount the local-disk store works."""
    sd = volume_state(1)
    with pytest.raises(CheckpointException) as info:
        save(sd, rclone_dir, volume=False)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CheckpointError)
    if "Illegal seek" in str(err):
        assert "volume=True" in str(err)
    assert not (rclone_dir / MANIFEST_NAME).exists()
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        CheckpointReader(rclone_dir).read_metadata()

    save(sd, weed_dir, volume=False)  # pwrite + link/rename: a network filesystem allows them
    assert_tree_equal(load(sd, weed_dir), sd)


# -- round trips ------------------------------------------------------------------------------------
def test_round_trip(volume_dir):
    sd = volume_state(2)
    writer = save(sd, volume_dir)
    assert writer.durable_future().done()
    names = sorted(os.listdir(volume_dir))
    assert MANIFEST_NAME in names and len(data_files(volume_dir)) == 4, names  # 4 files, one per thread
    assert names == sorted([MANIFEST_NAME, *data_files(volume_dir)]), "no temporary or marker files"
    assert_tree_equal(load(sd, volume_dir), sd)
    # A sub-range of a tensor: the reader reads just the chunks it needs.
    part = {"w": torch.zeros(3_000_000)}
    dcp.load(part, storage_reader=CheckpointReader(volume_dir, thread_count=3))
    assert torch.equal(part["w"], sd["w"])


def test_mounts_are_read_with_o_direct(volume_dir):
    """Both FUSE mounts take O_DIRECT reads at unaligned offsets into unaligned buffers (the
    volume store's default: docs/volumes.md), and they return the bytes written."""
    from goodput_ckpt.storage import VolumeStore

    data = os.urandom((2 << 20) + 123)
    store = VolumeStore(str(volume_dir))
    store.prepare()
    sink = store.open_sink("d.bin")
    sink.write_at(0, [data])
    sink.close()
    src = store.open_source("d.bin")
    buf = bytearray((1 << 20) + 1)
    src.read_into(4097, [memoryview(buf)[1:], bytearray(7)])
    assert bytes(buf[1:]) == data[4097 : 4097 + (1 << 20)]
    assert src.direct, "the mount refused O_DIRECT: reads fell back to buffered"
    src.close()


def test_async_save_with_the_thread_executor(rclone_dir):
    sd, expected = volume_state(3), volume_state(3)
    writer = CheckpointWriter(rclone_dir)
    fut = dcp.async_save(sd, storage_writer=writer)
    sd["w"].add_(1)  # training goes on: the checkpoint must not see it
    fut.result(timeout=120)
    assert_tree_equal(load(expected, rclone_dir), expected)


# -- existing checkpoints ----------------------------------------------------------------------------
def test_overwrite_refused_unless_asked(volume_dir):
    old, new = volume_state(4), volume_state(5)
    save(old, volume_dir)
    old_files = data_files(volume_dir)
    with pytest.raises(CheckpointException) as info:
        save(new, volume_dir)
    assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)
    assert data_files(volume_dir) == old_files
    assert_tree_equal(load(old, volume_dir), old)
    save(new, volume_dir, overwrite=True)
    assert_tree_equal(load(new, volume_dir), new)
    assert not set(old_files) & set(data_files(volume_dir)), "the old data files were removed"


# -- damage -----------------------------------------------------------------------------------------
def test_corruption_is_detected(rclone_dir):
    sd = volume_state(6)
    save(sd, rclone_dir)
    manifest = (rclone_dir / MANIFEST_NAME).read_bytes()
    biggest = max(data_files(rclone_dir), key=lambda n: (rclone_dir / n).stat().st_size)
    original = (rclone_dir / biggest).read_bytes()

    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    rewrite(rclone_dir / biggest, bytes(flipped))
    with pytest.raises(CheckpointException) as info:
        load(sd, rclone_dir)
    err = find_checkpoint_error(info.value)
    assert isinstance(err, CorruptCheckpointError) and biggest in str(err) and err.byte_range is not None, err

    rewrite(rclone_dir / biggest, original[:-100])  # truncated
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        CheckpointReader(rclone_dir).read_metadata()
    (rclone_dir / biggest).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        CheckpointReader(rclone_dir).read_metadata()
    rewrite(rclone_dir / biggest, original)
    assert_tree_equal(load(sd, rclone_dir), sd)

    # A half-written manifest (a killed upload completes with what it had) is never a commit.
    rewrite(rclone_dir / MANIFEST_NAME, manifest[: len(manifest) // 2])
    with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
        CheckpointReader(rclone_dir).read_metadata()
    save(volume_state(7), rclone_dir)  # an incomplete location takes a new save without overwrite
    assert_tree_equal(load(volume_state(7), rclone_dir), volume_state(7))


def test_tools_call_a_half_written_manifest_incomplete(rclone_volume):
    """verify, inspect and ls judge the manifest as the reader does: on the mount a manifest cut
    short (what a killed upload leaves) is an uncommitted save, never corruption; a damaged data
    file under a valid manifest is still corruption."""
    from goodput_ckpt.tools import inspect_checkpoint, list_checkpoints, verify_checkpoint

    root = rclone_volume.fresh("tools")
    step, other = root / "step_00000100", root / "step_00000200"
    save(volume_state(10), step)
    save(volume_state(11), other)
    manifest = (step / MANIFEST_NAME).read_bytes()
    assert verify_checkpoint(str(step)).ok
    rewrite(step / MANIFEST_NAME, manifest[: len(manifest) // 2])
    report = verify_checkpoint(str(step))
    assert report.status == "incomplete" and [p.kind for p in report.problems] == ["incomplete"], report.problems
    assert "mounted volume" in report.problems[0].message
    with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
        inspect_checkpoint(str(step))
    with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
        CheckpointReader(step).read_metadata()
    listing = list_checkpoints(str(root), verify=True)
    assert [(c.step, c.status) for c in listing.checkpoints] == [(100, "incomplete"), (200, "complete")]
    assert listing.latest_complete == 200

    biggest = max(data_files(other), key=lambda n: (other / n).stat().st_size)
    data = bytearray((other / biggest).read_bytes())
    data[len(data) // 2] ^= 0xFF
    rewrite(other / biggest, bytes(data))
    report = verify_checkpoint(str(other))
    assert report.status == "corrupt" and [p.kind for p in report.problems] == ["checksum"]
    assert [c.status for c in list_checkpoints(str(root), verify=True).checkpoints] == ["incomplete", "corrupt"]


def test_save_killed_mid_write_leaves_it_incomplete(rclone_volume, tmp_path):
    """SIGKILL while the data files are being written: the mount finishes the uploads with what
    it had, but no manifest exists, so the location reads as incomplete; a new save there then
    works without overwrite and removes the leftovers."""
    loc = rclone_volume.fresh("killed")

    def written() -> bool:
        try:
            return sum((loc / n).stat().st_size for n in data_files(loc)) >= 4 * MiB
        except FileNotFoundError:
            return False

    kill_when([sys.executable, str(SAVE_WORKER), str(loc), "1", "--mib", "48"], tmp_path / "worker.log", written)
    leftovers = data_files(loc)
    assert leftovers and MANIFEST_NAME not in os.listdir(loc)
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        CheckpointReader(loc).read_metadata()
    sd = volume_state(8)
    save(sd, loc)
    assert not set(leftovers) & set(data_files(loc))
    assert_tree_equal(load(sd, loc), sd)


# -- local staging -------------------------------------------------------------------------------------
def test_staged_save_uploads_in_the_background(rclone_volume, tmp_path):
    sd = volume_state(9)
    loc, stage = rclone_volume.fresh("staged"), tmp_path / "stage"
    writer = CheckpointWriter(loc, stage_dir=stage)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=writer)
    blocked = time.perf_counter() - t0
    durable = writer.durable_future()
    durable.result(timeout=120)
    total = time.perf_counter() - t0
    assert blocked <= total
    assert MANIFEST_NAME in os.listdir(loc)
    # The markers are deleted after the commit. rclone's listing of an object deleted right
    # after it was created can lag (seen once in CI): allow it a bounded time to catch up.
    wait_until(
        lambda: not [n for n in os.listdir(loc) if n.endswith(".uploaded")], 15, interval=0.5, what="markers gone"
    )
    assert list(stage.iterdir()) == [], "uploaded files leave the stage"
    assert_tree_equal(load(sd, loc), sd)

    # async_save, then the durable copy; a second staged save refuses the committed location.
    sd2 = volume_state(10)
    loc2 = rclone_volume.fresh("staged")
    writer2 = CheckpointWriter(loc2, stage_dir=stage)
    dcp.async_save(sd2, storage_writer=writer2).result(timeout=120)
    writer2.durable_future().result(timeout=120)
    assert_tree_equal(load(sd2, loc2), sd2)
    with pytest.raises(CheckpointException) as info:
        save(sd, loc2, stage_dir=stage)
    assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)


def test_upload_markers_are_never_empty_so_deleting_them_sticks(rclone_volume, seaweed_server, tmp_path):
    """``rclone mount`` uploads a file that got no write only when the kernel releases it,
    after ``close`` returned: an empty marker deleted at once came back and stayed (seen in
    CI). A marker holds its file's size, and a marker deleted right after its upload is gone.

    The evidence is the bucket once a private mount of it is unmounted: by then every release
    has reached rclone and rclone has exited, so a late upload would already be there."""
    bucket = rclone_volume.mount.bucket
    mount = RcloneMount(seaweed_server.url, bucket, tmp_path / "mnt", tmp_path / "rclone")
    prefix = f"markers-{os.getpid()}-{time.monotonic_ns()}"
    try:
        loc = mount.path / prefix
        store = StagedStore(VolumeStore(str(loc)), str(tmp_path / "stage"))
        store.prepare()
        sink = store.open_sink("a.bin")
        sink.write_at(0, [b"x" * 1000])
        sink.close()  # the last open file: its upload is queued
        store.durable_future().result(timeout=60)
        assert (loc / "a.bin.uploaded").read_bytes() == b"1000"
        store.inner.delete("a.bin.uploaded")
    finally:
        mount.stop()
    client = boto3.client(
        "s3",
        endpoint_url=seaweed_server.url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    assert sorted(o["Key"] for o in listed) == [f"{prefix}/a.bin"]


def test_readme_volume_example_runs(rclone_volume, tmp_path):
    """The README's mounted-volume example, with its paths moved onto the strict mount."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Mounted volumes", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    root = rclone_volume.fresh("readme")
    code = code.replace("/Volumes/main/ml/ckpts", str(root)).replace("/local_disk0/stage", str(tmp_path / "stage"))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    for step in ("step_100", "step_200"):
        assert (root / step / MANIFEST_NAME).exists()
    assert namespace["state"]["step"] == 100
