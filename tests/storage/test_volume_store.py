"""Volume mode without a mount: detection from a mount table, options, and the store's rules
(forced with ``volume=True`` on a local directory). The same code on real FUSE mounts is in
test_volume.py."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.trees import make_state, zeros_like
from helpers.wait import wait_until

from goodput_ckpt import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReader,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.errors import CheckpointExistsError, find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.storage import LocalStore, StagedStore, VolumeConfig, VolumeStore, find_volume, open_store
from goodput_ckpt.storage.mounts import find_mount

MOUNTINFO = textwrap.dedent(
    r"""
    22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
    30 22 0:40 / /mnt/rclone rw,nosuid,nodev,relatime - fuse.rclone remote:bucket rw,user_id=0,group_id=0
    31 22 0:41 / /mnt/nfs rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2
    32 31 253:2 / /mnt/nfs/local rw,relatime - ext4 /dev/vdb rw
    33 22 0:42 / /mnt/smb\040share rw - cifs //host/share rw
    34 22 0:43 / /lustre rw - lustre 10.0.0.1@tcp:/fs rw
    35 22 0:44 / /dev/shm rw - tmpfs tmpfs rw
    36 22 0:45 / /mnt/gcs rw - fuse gcsfuse rw
    """
).strip()


@pytest.fixture
def mountinfo(tmp_path):
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO + "\n")
    return str(path)


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/mnt/rclone/run/step_1", "fuse.rclone"),
        ("/mnt/rclone", "fuse.rclone"),
        ("/mnt/nfs/ckpt", "nfs4"),
        ("/mnt/smb share/x", "cifs"),  # an escaped space in the mount point
        ("/lustre/scratch/x", "lustre"),
        ("/mnt/gcs/a", "fuse"),
    ],
)
def test_detects_volume_mounts(mountinfo, path, fstype):
    why = find_volume(path, mountinfo=mountinfo)
    assert why is not None and fstype in why


@pytest.mark.parametrize("path", ["/home/u/ckpt", "/mnt/nfs/local/ckpt", "/dev/shm/x", "/mnt/rclonex/a"])
def test_local_paths_are_not_volumes(mountinfo, path):
    # /mnt/nfs/local is a local disk mounted inside the NFS mount: the longest prefix wins.
    assert find_volume(path, mountinfo=mountinfo) is None


def test_databricks_volumes_path_is_a_volume_without_a_mount_table(tmp_path):
    empty = tmp_path / "none"
    empty.write_text("")
    assert find_volume("/Volumes/main/default/vol/ckpt", mountinfo=str(empty)) is not None
    assert find_volume("/Volumesx/a", mountinfo=str(empty)) is None


def test_mount_lookup_resolves_symlinks(tmp_path, mountinfo):
    link = tmp_path / "link"
    os.symlink("/dev/shm", link)
    assert find_mount(link / "not-yet" / "there", mountinfo=mountinfo).fstype == "tmpfs"


def test_open_store_detects_and_the_option_overrides(tmp_path):
    loc = str(tmp_path / "ckpt")
    assert type(open_store(loc)) is LocalStore  # tmp is local disk here
    assert type(open_store(loc, {"volume": True})) is VolumeStore
    assert type(open_store(loc, {"volume": False})) is LocalStore
    staged = open_store(loc, {"volume": True, "stage_dir": str(tmp_path / "stage")})
    assert isinstance(staged, StagedStore) and isinstance(staged.inner, VolumeStore)
    with pytest.raises(TypeError, match="volume=True"):
        open_store(loc, {"stage_dir": str(tmp_path / "stage")})  # not detected as a volume
    with pytest.raises(TypeError, match="volume=False"):
        open_store(loc, {"volume": False, "stage_dir": str(tmp_path / "stage")})
    with pytest.raises(TypeError, match="volume must be"):
        open_store(loc, {"volume": "yes"})
    with pytest.raises(TypeError, match="unknown option"):
        open_store(loc, {"volume": True, "bogus": 1})
    with pytest.raises(TypeError, match="unknown option.*volume"):
        open_store("s3://bucket/prefix", {"volume": True})


def test_volume_config_checks_combinations():
    with pytest.raises(ValueError, match="only apply with stage_dir"):
        VolumeConfig(upload_threads=2)
    with pytest.raises(ValueError, match="upload_threads"):
        VolumeConfig(stage_dir="/tmp/s", upload_threads=0)
    with pytest.raises(ValueError, match="commit_timeout_s"):
        VolumeConfig(stage_dir="/tmp/s", commit_timeout_s=-1)
    with pytest.raises(TypeError):
        VolumeConfig(fsync="yes")
    with pytest.raises(TypeError, match="direct_reads"):
        VolumeConfig(direct_reads=1)
    assert VolumeConfig(stage_dir="rel").stage_dir == os.path.abspath("rel")


def test_sink_takes_writes_in_order_only(tmp_path):
    store = VolumeStore(str(tmp_path / "v"))
    store.prepare()
    sink = store.open_sink("a.bin")
    sink.write_at(0, [b"ab", b"", memoryview(b"cd")])  # pieces are joined into one write
    sink.write_at(4, [b"ef"])
    with pytest.raises(CheckpointError, match="strictly in order"):
        sink.write_at(2, [b"xx"])
    big = [bytes([1]) * (3 << 19), bytes([2]) * (3 << 19)]  # large pieces: one writev, no copy
    sink.write_at(6, big)
    sink.close()
    sink.close()
    assert (tmp_path / "v" / "a.bin").read_bytes() == b"abcdef" + big[0] + big[1]
    sink = store.open_sink("b.bin")
    sink.write_at(0, [b"partial"])
    sink.abort()
    assert store.size("b.bin") is None


def test_source_reads_ranges_with_several_descriptors(tmp_path):
    store = VolumeStore(str(tmp_path))
    data = bytes(range(256)) * 400
    (tmp_path / "d.bin").write_bytes(data)
    src = store.open_source("d.bin")
    a, b = bytearray(100), bytearray(50)
    src.read_into(1000, [a, b])
    assert bytes(a + b) == data[1000:1150]
    src.read_into(1150, [b])  # continues the same descriptor's sequential position
    assert bytes(b) == data[1150:1200]
    with pytest.raises(IncompleteCheckpointError) as info:
        src.read_into(len(data) - 10, [bytearray(20)])
    assert info.value.byte_range == (len(data) - 10, len(data) + 10)
    src.close()
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        store.open_source("nope.bin")


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_source_reads_direct_and_drops_to_aligned_reads_when_refused(tmp_path):
    """Descriptors are opened with O_DIRECT and read unaligned (what FUSE mounts take); ext4
    refuses an unaligned direct read (EINVAL), and the same range is read again with aligned
    direct reads (direct_read.py), still without the page cache."""
    if find_volume(str(tmp_path)) is not None:
        pytest.skip("the temporary directory is on a mount that takes unaligned direct reads")
    data = os.urandom(3 << 20)
    (tmp_path / "d.bin").write_bytes(data)
    src = VolumeStore(str(tmp_path)).open_source("d.bin")
    assert src.level == "unaligned"
    buf = bytearray((1 << 20) + 3)
    src.read_into(4097, [memoryview(buf)[1:], bytearray(5)])  # unaligned offset and buffer
    assert bytes(buf[1:]) == data[4097 : 4097 + (1 << 20) + 2]
    assert src.level == "aligned" and src.direct
    src.read_into(0, [buf])
    assert bytes(buf) == data[: len(buf)]
    src.close()


def test_source_reads_buffered_when_off(tmp_path):
    data = bytes(range(256)) * 64
    (tmp_path / "d.bin").write_bytes(data)
    off = VolumeStore(str(tmp_path), VolumeConfig(direct_reads=False)).open_source("d.bin")
    assert not off.direct
    buf = bytearray(100)
    off.read_into(7, [buf])
    assert bytes(buf) == data[7:107]
    off.close()


def test_commit_record_is_written_in_place_without_rename(tmp_path):
    store = VolumeStore(str(tmp_path))
    store.put_commit_record(MANIFEST_NAME, b"one", replace=False)
    with pytest.raises(CheckpointExistsError):
        store.put_commit_record(MANIFEST_NAME, b"two", replace=False)
    store.put_commit_record(MANIFEST_NAME, b"three", replace=True)
    assert store.read_small(MANIFEST_NAME) == b"three"
    assert store.list() == [MANIFEST_NAME]


def test_store_code_never_renames():
    """No rename or link in the volume path: a strict mount refuses them (a static check)."""
    import goodput_ckpt.storage.staged as staged
    import goodput_ckpt.storage.volume as volume

    for mod in (volume, staged):
        src = open(mod.__file__).read()
        for call in ("os.rename", "os.replace", "os.link", ".rename(", "_link_exclusive"):
            assert call not in src, f"{mod.__name__} calls {call}"


def _state(seed: int = 0) -> dict:
    return make_state(seed, numel=60_000)  # 240 kB


def _load(path, **options) -> dict:
    out = zeros_like(_state())
    dcp.load(out, storage_reader=CheckpointReader(path, **options))
    return out


def test_truncated_manifest_on_a_volume_is_incomplete_not_corrupt(tmp_path):
    loc = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=CheckpointWriter(loc, volume=True))
    manifest = (loc / MANIFEST_NAME).read_bytes()
    (loc / MANIFEST_NAME).write_bytes(manifest[: len(manifest) // 2])  # what a killed upload leaves
    # (dcp.load turns read_metadata's error into a bare AssertionError: ask the reader itself.)
    with pytest.raises(IncompleteCheckpointError, match="mounted volume"):
        CheckpointReader(loc, volume=True).read_metadata()
    # The same bytes on local disk are a damaged commit record.
    with pytest.raises(CorruptCheckpointError):
        CheckpointReader(loc, volume=False).read_metadata()
    # An unfinished record is no checkpoint: a new save goes in without overwrite=True.
    dcp.save(_state(2), storage_writer=CheckpointWriter(loc, volume=True))
    assert _load(loc, volume=True)["step"] == 2
    assert sorted(p.name for p in loc.iterdir() if p.name.endswith(".bin")) == sorted(
        n for n in os.listdir(loc) if n != MANIFEST_NAME
    ), "only the new save's data files remain"


def test_staged_save_round_trip_and_durable_future(tmp_path):
    loc, stage = tmp_path / "vol" / "ckpt", tmp_path / "stage"
    writer = CheckpointWriter(loc, volume=True, stage_dir=stage)
    with pytest.raises(CheckpointError, match="no save"):
        writer.durable_future()
    dcp.save(_state(3), storage_writer=writer)
    writer.durable_future().result(timeout=60)
    assert (loc / MANIFEST_NAME).exists()
    assert not any(n.endswith(".uploaded") for n in os.listdir(loc)), "markers are removed after the commit"
    assert list(stage.iterdir()) == [], "the staged copy is removed once uploaded"
    out = _load(loc, volume=True)
    assert torch.equal(out["w"], _state(3)["w"]) and out["step"] == 3
    with pytest.raises(TypeError, match="process executor"):
        pickle.dumps(writer)
    # Without staging the future is done when dcp.save returns.
    plain = CheckpointWriter(tmp_path / "plain")
    dcp.save(_state(4), storage_writer=plain)
    assert plain.durable_future().done()


def test_staged_save_refuses_an_existing_checkpoint(tmp_path):
    loc = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=CheckpointWriter(loc, volume=True))
    with pytest.raises(BaseException) as info:
        dcp.save(_state(2), storage_writer=CheckpointWriter(loc, volume=True, stage_dir=tmp_path / "s"))
    assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)
    w = CheckpointWriter(loc, volume=True, stage_dir=tmp_path / "s", overwrite=True)
    dcp.save(_state(2), storage_writer=w)
    w.durable_future().result(timeout=60)
    assert _load(loc, volume=True)["step"] == 2


def test_a_clean_up_error_after_the_commit_does_not_fail_the_save(tmp_path, monkeypatch, caplog):
    """Once the manifest is on the volume the checkpoint is committed: an error deleting the
    upload markers (EIO on a FUSE mount, say) is logged, not reported as a failed save."""
    loc = tmp_path / "vol" / "ckpt"

    def broken_delete(self, name):
        if name.endswith(".uploaded"):
            raise OSError(errno.EIO, "Input/output error", name)
        return original(self, name)

    original = VolumeStore.delete
    monkeypatch.setattr(VolumeStore, "delete", broken_delete)
    writer = CheckpointWriter(loc, volume=True, stage_dir=tmp_path / "stage")
    with caplog.at_level("WARNING", logger="goodput_ckpt"):
        dcp.save(_state(5), storage_writer=writer)
        writer.durable_future().result(timeout=60)
    assert (loc / MANIFEST_NAME).exists()
    assert any("deleting its upload markers failed" in r.getMessage() for r in caplog.records)
    assert _load(loc, volume=True)["step"] == 5


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_failed_upload_fails_the_durable_future(tmp_path):
    """A volume that fills up during the background upload (a 1 MiB tmpfs forced into volume
    mode): dcp.save succeeds locally, the future fails with the disk-full error, and the volume
    holds no manifest."""
    vol = tmp_path / "tiny"
    vol.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(vol)], check=True)
    try:
        writer = CheckpointWriter(vol / "ckpt", volume=True, stage_dir=tmp_path / "stage")
        dcp.save({"w": torch.randn(1 << 20)}, storage_writer=writer)  # 4 MiB: lands locally
        with pytest.raises(CheckpointError, match="full"):
            writer.durable_future().result(timeout=60)
        assert not (vol / "ckpt" / MANIFEST_NAME).exists()
        with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
            CheckpointReader(vol / "ckpt", volume=True).read_metadata()
    finally:
        subprocess.run(["umount", str(vol)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_failed_staged_save_leaves_nothing_on_the_volume(tmp_path):
    """The stage fills up mid-save (a 3 MiB tmpfs, four 1 MiB files plus one of 4 MiB): files
    closed before the failure had their uploads queued; the failure withdraws them, so the
    volume ends up with no data file, marker or manifest."""
    stage = tmp_path / "stage"
    stage.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(stage)], check=True)
    try:
        loc = tmp_path / "vol" / "ckpt"
        state = {f"w{i}": torch.randn(1 << 18) for i in range(4)}  # 1 MiB each
        state["big"] = torch.randn(1 << 20)  # 4 MiB: does not fit
        with pytest.raises(BaseException) as info:
            dcp.save(state, storage_writer=CheckpointWriter(loc, volume=True, stage_dir=stage))
        assert isinstance(find_checkpoint_error(info.value), CheckpointError)
        # Uploads already running are deleted when they finish.
        wait_until(lambda: os.listdir(loc) == [], 30, interval=0.05, what=f"{loc} emptied")
    finally:
        subprocess.run(["umount", str(stage)], check=True)


@pytest.mark.parametrize("volume", [True, False])
def test_saving_over_a_torn_record(tmp_path, volume):
    """A location whose manifest does not validate: on a volume it is the record of a killed
    save (incomplete), so a new save goes in without overwrite=True; on local disk, where
    records commit atomically, it is a damaged commit and is refused like any checkpoint."""
    loc = tmp_path / "loc"
    state = {"w": torch.arange(64, dtype=torch.float32)}
    dcp.save(state, storage_writer=CheckpointWriter(loc, volume=volume))
    (loc / MANIFEST_NAME).write_bytes((loc / MANIFEST_NAME).read_bytes()[:40])
    if not volume:
        with pytest.raises(BaseException) as info:
            dcp.save(state, storage_writer=CheckpointWriter(loc, volume=volume))
        assert isinstance(find_checkpoint_error(info.value), CheckpointExistsError)
        return
    dcp.save({"w": state["w"] + 1}, storage_writer=CheckpointWriter(loc, volume=volume))
    dest = {"w": torch.zeros(64)}
    dcp.load(dest, storage_reader=CheckpointReader(loc, volume=volume))
    assert torch.equal(dest["w"], state["w"] + 1)
