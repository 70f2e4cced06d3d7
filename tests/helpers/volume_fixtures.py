"""Pytest fixtures for the mounted-volume tests (imported by tests/helpers/store_fixtures.py).

One SeaweedFS server (the S3 tests' ``seaweed_server``) serves two session-wide FUSE mounts of two
buckets: ``rclone_volume`` (strict, checked by :func:`~helpers.volume.assert_strict`) and
``weed_volume`` (permissive). Tests get a fresh directory on a mount: ``rclone_dir``,
``weed_dir``, or ``volume_dir`` (parametrized over both). Without FUSE (no ``/dev/fuse``, or the
tools missing and no root to install them) these tests skip and say why.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.volume import RcloneMount, WeedMount, assert_strict, fuse_unavailable

__all__ = ["Volume", "rclone_dir", "rclone_volume", "volume_dir", "weed_dir", "weed_volume"]

_dir_ids = itertools.count()


@dataclass
class Volume:
    kind: str  # "rclone" (strict) | "weed" (permissive)
    mount: RcloneMount | WeedMount

    @property
    def path(self) -> Path:
        return self.mount.path

    def fresh(self, stem: str = "t") -> Path:
        """A path on the mount that does not exist yet."""
        return self.path / f"{stem}-{next(_dir_ids)}"


def _require_fuse() -> None:
    why = fuse_unavailable()
    if why is not None:
        pytest.skip(f"mounted-volume tests need FUSE: {why}")


def _bucket(server, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=server.url, region_name="us-east-1").create_bucket(Bucket=name)


@pytest.fixture(scope="session")
def rclone_volume(request, tmp_path_factory):
    """``rclone mount --vfs-cache-mode off`` over SeaweedFS S3, checked to be strict."""
    _require_fuse()  # before starting a server for nothing
    seaweed_server = request.getfixturevalue("seaweed_server")
    _bucket(seaweed_server, "goodput-volume-rclone")
    work = tmp_path_factory.mktemp("rclone")
    mount = RcloneMount(seaweed_server.url, "goodput-volume-rclone", work / "mnt", work)
    try:
        assert_strict(mount.path)
        yield Volume("rclone", mount)
    finally:
        mount.stop()


@pytest.fixture(scope="session")
def weed_volume(request, tmp_path_factory):
    """``weed mount`` of a SeaweedFS bucket: a permissive network filesystem."""
    _require_fuse()
    seaweed_server = request.getfixturevalue("seaweed_server")
    _bucket(seaweed_server, "goodput-volume-weed")
    work = tmp_path_factory.mktemp("weedmount")
    mount = WeedMount(seaweed_server.filer_port, "goodput-volume-weed", work / "mnt", work)
    try:
        yield Volume("weed", mount)
    finally:
        mount.stop()


@pytest.fixture
def rclone_dir(rclone_volume) -> Path:
    """A fresh directory path on the strict mount."""
    return rclone_volume.fresh()


@pytest.fixture
def weed_dir(weed_volume) -> Path:
    """A fresh directory path on the permissive mount."""
    return weed_volume.fresh()


@pytest.fixture(params=["rclone", "weed"])
def volume_dir(request) -> Path:
    """A fresh directory path on each mount in turn."""
    return request.getfixturevalue(f"{request.param}_volume").fresh()
