"""Which S3 errors mean "not found" and "no such upload": one predicate each, used by every request
(before, the read path and the HEAD path each had their own, and only one took the code "404")."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from goodput_ckpt import IncompleteCheckpointError
from goodput_ckpt.errors import FileTooLargeError
from goodput_ckpt.storage import open_store
from goodput_ckpt.storage._s3_retry import is_no_such_upload, is_not_found


def _error(code: str, status: int | None) -> ClientError:
    response = {"Error": {"Code": code, "Message": "m"}}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "GetObject")


@pytest.mark.parametrize(
    "code, status, missing",
    [
        ("NoSuchKey", 404, True),
        ("NotFound", 404, True),  # HEAD: no body, botocore names the status
        ("404", None, True),  # HEAD through a proxy that drops the status line's metadata
        ("", 404, True),
        ("NoSuchBucket", 404, False),  # a setup error, not a missing file
        ("AccessDenied", 403, False),
        ("NoSuchUpload", 404, True),  # as a GET answer it is still "not there"
    ],
)
def test_not_found(code, status, missing):
    assert is_not_found(_error(code, status)) is missing


def test_no_such_upload():
    assert is_no_such_upload(_error("NoSuchUpload", 404))
    assert not is_no_such_upload(_error("NoSuchKey", 404)) and not is_no_such_upload(ValueError("x"))


def test_the_read_path_and_the_head_path_agree(moto):
    """A missing object: ``size`` and ``read_small`` say None, a ranged read says missing."""
    store = open_store(moto.uri("ckpt"), moto.options())
    assert store.size("gone.bin") is None and store.read_small("gone.bin") is None
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        store.open_source("gone.bin").read_into(0, [bytearray(3)])


def test_read_small_refuses_a_large_object_from_its_size(moto):
    """The object's size comes with a ranged GET of at most the cap plus one byte: nothing beyond
    that is downloaded, whatever the object holds."""
    size = 6 << 20
    moto.client().put_object(Bucket=moto.bucket, Key="ckpt/manifest.json", Body=b"m" * size)
    store = open_store(moto.uri("ckpt"), moto.options())
    with pytest.raises(FileTooLargeError, match=rf"manifest.json holds {size} bytes, over the {1 << 20}-byte limit"):
        store.read_small("manifest.json", max_bytes=1 << 20)
    assert store.read_small("manifest.json", max_bytes=size) == b"m" * size
    moto.client().put_object(Bucket=moto.bucket, Key="ckpt/empty.json", Body=b"")
    assert store.read_small("empty.json") == b""
