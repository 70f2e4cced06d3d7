"""Fixtures of real stores, shared by every test folder (a plugin of tests/conftest.py): real S3
servers on 127.0.0.1 and FUSE mounts over them, each started at most once per session, and only
when a test asks for it.

``moto`` (in-process, quick) serves the S3-semantics and fault tests; ``seaweed`` (a real object
store in its own process, stopped by PID) the integration tests. ``s3`` is parametrized over
both. Each test gets a fresh bucket through :class:`S3Target`.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import pytest

from helpers.s3 import FaultProxy, MotoServer, SeaweedServer, s3_env

_bucket_ids = itertools.count()


@dataclass
class S3Target:
    """A fresh bucket on one server, with the options that reach it."""

    server: str  # "moto" | "seaweedfs"
    url: str  # the endpoint clients talk to (the server's, or a proxy's)
    bucket: str

    def options(self, **extra: Any) -> dict[str, Any]:
        """Options for CheckpointWriter/CheckpointReader/open_store."""
        return {"endpoint_url": self.url, "addressing_style": "path", "region": "us-east-1", **extra}

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self):
        """A plain boto3 client (straight to the server) for checking what is stored."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

    def open_uploads(self) -> list[str]:
        """Keys of multipart uploads started and neither completed nor aborted."""
        return [u["Key"] for u in self.client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", ())]

    def drop(self) -> None:
        """Delete the bucket and everything in it (best effort), after its test.

        Why: SeaweedFS gives each bucket a collection of volumes of its own (7 at its first
        write) out of the server's ``-volume.max``, and frees them only when the bucket is
        deleted; a session-long server that keeps every test's bucket runs out after about 29
        buckets with data and then answers every write ``InternalError``."""
        client = self.client()
        try:
            for up in client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", ()):
                client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
            keys = self.keys()
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            client.delete_bucket(Bucket=self.bucket)
        except Exception:  # noqa: BLE001 - a test that broke its bucket must not fail the next one
            pass


@pytest.fixture(scope="session")
def s3_environ():
    """Dummy credentials for every client in this process and the ranks it spawns."""
    env = s3_env()
    dropped = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")
    saved = {k: os.environ.get(k) for k in [*env, *dropped]}
    for k in dropped:
        os.environ.pop(k, None)
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server(s3_environ):
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_server(s3_environ, tmp_path_factory):
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


def _new_bucket(server_name: str, url: str) -> S3Target:
    target = S3Target(server_name, url, f"goodput-test-{os.getpid()}-{next(_bucket_ids)}")
    target.client().create_bucket(Bucket=target.bucket)
    return target


@pytest.fixture
def moto(moto_server) -> S3Target:
    """A fresh bucket on the moto server."""
    return _new_bucket("moto", moto_server.url)


@pytest.fixture
def seaweed(seaweed_server) -> S3Target:
    """A fresh bucket on the SeaweedFS server, deleted after the test (:meth:`S3Target.drop`)."""
    target = _new_bucket("seaweedfs", seaweed_server.url)
    yield target
    target.drop()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3(request) -> S3Target:
    """A fresh bucket on each real server in turn, deleted after the test."""
    server = request.getfixturevalue("moto_server" if request.param == "moto" else "seaweed_server")
    target = _new_bucket(request.param, server.url)
    yield target
    target.drop()


@pytest.fixture
def proxy(moto_server):
    """A fault proxy in front of moto (rules added by the test)."""
    p = FaultProxy(moto_server.url)
    yield p
    p.stop()


# Mounted-volume fixtures (FUSE mounts over the SeaweedFS server above): tests/helpers/volume_fixtures.py.
from helpers.volume_fixtures import rclone_dir, rclone_volume, volume_dir, weed_dir, weed_volume  # noqa: E402, F401
