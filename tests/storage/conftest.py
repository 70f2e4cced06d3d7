"""Fixtures shared by the storage tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: a real filesystem that refuses ``O_DIRECT`` at open (``EINVAL``), for the
    direct-I/O fallbacks (root only; skipped otherwise)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount ramfs here (not root?)")
    try:
        yield mnt
    finally:
        # Lazy: a file a failed test left open must not keep the mount (and pytest's clean-up of
        # tmp_path) stuck for the rest of the machine's life; checked, so a leak fails the test.
        subprocess.run(["umount", "--lazy", str(mnt)], check=True, capture_output=True)


@pytest.fixture
def roomy_machine(monkeypatch):
    """The automatic write mode sees a machine with CPUs and memory to spare, whatever this one
    is doing now: a synchronous local save then writes through the page cache."""
    from goodput_ckpt.storage import write_mode

    for limit in ("CPU_PRESSURE_LIMIT", "MEMORY_PRESSURE_LIMIT", "LOAD_PER_CPU_LIMIT"):
        monkeypatch.setattr(write_mode, limit, float("inf"))


@pytest.fixture
def contended_machine(monkeypatch):
    """The automatic write mode sees contended CPUs (any pressure, any load is above its limits):
    a synchronous local save then writes around the page cache."""
    from goodput_ckpt.storage import write_mode

    for limit in ("CPU_PRESSURE_LIMIT", "MEMORY_PRESSURE_LIMIT", "LOAD_PER_CPU_LIMIT"):
        monkeypatch.setattr(write_mode, limit, 0.0)


@pytest.fixture
def big_sector_fs(tmp_path):
    """An XFS filesystem on a loop device with 16 KiB logical sectors: a real filesystem that
    opens files with ``O_DIRECT`` but refuses a direct write aligned to 4 KiB, our alignment
    (``EINVAL`` at the first write). Root, ``losetup`` and ``mkfs.xfs`` only; skipped otherwise."""
    image = tmp_path / "xfs16k.img"
    mnt = tmp_path / "xfs16k"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # XFS's smallest filesystem at this block size is about 300 MiB
    try:
        loop = subprocess.run(
            ["losetup", "--show", "-f", "--sector-size", "16384", str(image)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("losetup is not installed")
    if loop.returncode != 0:
        pytest.skip(f"cannot make a loop device with 16 KiB sectors here: {loop.stderr.strip()}")
    device = loop.stdout.strip()
    try:
        for cmd in (
            ["mkfs.xfs", "-q", "-f", "-b", "size=16384", "-s", "size=16384", device],
            ["mount", device, str(mnt)],
        ):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True)
            except FileNotFoundError:
                pytest.skip(f"{cmd[0]} is not installed")
            if done.returncode != 0:
                pytest.skip(f"{' '.join(cmd[:2])} failed here: {done.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "--lazy", str(mnt)], check=True, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)
