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
