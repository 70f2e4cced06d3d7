"""Multipart uploads left open by killed saves: aborted when a save starts at their location,
only there, and only once idle (``S3Config.stale_upload_age``, ``S3Store.abort_stale_uploads``)."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
from _kill import kill_when
from helpers.s3_roundtrip import load, s3_state, save
from helpers.trees import assert_tree_equal

from goodput_ckpt.storage import open_store

#: A save big enough to be killed mid-upload on moto (~100 MiB/s): 4 tensors of 24 MiB.
_WORKER = textwrap.dedent(
    """
    import sys, warnings
    import torch, torch.distributed.checkpoint as dcp
    from goodput_ckpt import CheckpointWriter
    warnings.filterwarnings("ignore")
    uri, url = sys.argv[1:3]
    sd = {f"t{i}": torch.full((6 << 20,), float(i)) for i in range(4)}
    print("READY", flush=True)
    writer = CheckpointWriter(uri, chunk_size=5 << 20, thread_count=1, endpoint_url=url,
                              addressing_style="path", region="us-east-1", max_concurrency=2)
    dcp.save(sd, storage_writer=writer)
    print("SAVED", flush=True)
    """
)


def start_upload(target, key: str, *, part: bool = True) -> str:
    """Open a multipart upload at ``key`` as a killed save leaves it (one part sent)."""
    client = target.client()
    upload_id = client.create_multipart_upload(Bucket=target.bucket, Key=key)["UploadId"]
    if part:
        client.upload_part(Bucket=target.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * 1000)
    return upload_id


def test_only_this_locations_idle_uploads_are_aborted(s3):
    for key in (
        "run/step_1/rank00000-00.aaaaaaaaaaaa.bin",
        "run/step_1/nested/x.bin",
        "run/step_10/y.bin",
        "run/step_1x.bin",
    ):
        start_upload(s3, key)
    # Just active (a part a moment ago): the default age keeps it, like a live writer's.
    save(s3_state(), s3, "run/step_1")
    assert sorted(s3.open_uploads()) == [
        "run/step_1/nested/x.bin",
        "run/step_1/rank00000-00.aaaaaaaaaaaa.bin",
        "run/step_10/y.bin",
        "run/step_1x.bin",
    ]
    # Idle for 0 s is idle: aborted when a save starts, but only this location's own files.
    save(s3_state(1), s3, "run/step_1", overwrite=True, stale_upload_age=0)
    assert sorted(s3.open_uploads()) == ["run/step_1/nested/x.bin", "run/step_10/y.bin", "run/step_1x.bin"]
    assert_tree_equal(load(s3_state(1), s3, "run/step_1"), s3_state(1))
    # Explicitly, with the nested locations (a manager root's steps).
    store = open_store(s3.uri("run/step_1"), s3.options())
    assert store.abort_stale_uploads(older_than=3600) == []  # nothing idle that long
    assert store.abort_stale_uploads(older_than=0, recursive=True) == ["run/step_1/nested/x.bin"]
    assert sorted(s3.open_uploads()) == ["run/step_10/y.bin", "run/step_1x.bin"]
    with pytest.raises(ValueError, match="older_than"):
        store.abort_stale_uploads(older_than=-1)


def test_no_clean_up_at_a_bucket_root_or_when_disabled(moto, proxy):
    target = type(moto)("moto", proxy.url, moto.bucket)
    start_upload(moto, "orphan.bin")
    save(s3_state(), target, "")  # the bucket's root: its uploads may be anyone's
    save(s3_state(), target, "off", stale_upload_age=None)
    assert proxy.count("ListMultipartUploads") == 0
    assert moto.open_uploads() == ["orphan.bin"]


def test_a_failed_clean_up_does_not_fail_the_save(moto, proxy, caplog):
    target = type(moto)("moto", proxy.url, moto.bucket)
    proxy.add("403_echo", op="ListMultipartUploads")  # a policy without ListBucketMultipartUploads
    start_upload(moto, "denied/orphan.bin")
    with caplog.at_level(logging.WARNING, logger="goodput_ckpt"):
        save(s3_state(), target, "denied", stale_upload_age=0)
    assert "could not clean up stale multipart uploads" in caplog.text and "SignatureDoesNotMatch" in caplog.text
    assert moto.open_uploads() == ["denied/orphan.bin"]
    assert_tree_equal(load(s3_state(), moto, "denied"), s3_state())


def test_uploads_of_a_killed_save_are_reclaimed_by_the_next_save(moto, tmp_path):
    worker = [sys.executable, "-c", _WORKER, moto.uri("killed"), moto.url]
    kill_when(worker, tmp_path / "worker.log", lambda: _uploads_with_parts(moto, "killed/"))
    orphans = [k for k in moto.open_uploads() if k.startswith("killed/")]
    assert orphans, "a multipart upload was left open"
    # Its last part went up a moment ago: the default age (600 s) leaves it to its writer.
    save(s3_state(), moto, "killed")
    assert sorted(k for k in moto.open_uploads() if k.startswith("killed/")) == sorted(orphans)
    # Once idle long enough (0 s here) the next save there reclaims it.
    save(s3_state(1), moto, "killed", overwrite=True, stale_upload_age=0)
    assert [k for k in moto.open_uploads() if k.startswith("killed/")] == []
    assert_tree_equal(load(s3_state(1), moto, "killed"), s3_state(1))


def _uploads_with_parts(target, prefix: str) -> bool:
    client = target.client()
    for upload in client.list_multipart_uploads(Bucket=target.bucket, Prefix=prefix).get("Uploads", ()):
        if client.list_parts(Bucket=target.bucket, Key=upload["Key"], UploadId=upload["UploadId"]).get("Parts"):
            return True
    return False


def test_manager_restore_aborts_every_orphaned_upload_under_its_root(moto):
    """A job restarting after a kill owns its root: uploads its dead saves left are aborted,
    however recent, in any step location; other roots are left alone."""
    import torch

    from goodput_ckpt import CheckpointManager

    start_upload(moto, "run/step_00000007/rank00000-00.abc.bin")
    start_upload(moto, "run/step_00000009/rank00001-00.abc.bin", part=False)
    start_upload(moto, "other-run/step_00000001/rank00000-00.abc.bin")
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(moto.uri("run"), async_save=False, **moto.options())
    assert mgr.restore(model=model) is None
    assert moto.open_uploads() == ["other-run/step_00000001/rank00000-00.abc.bin"]
    mgr.save(1, model=model)
    assert mgr.restore(model=model) == 1
    mgr.close()
