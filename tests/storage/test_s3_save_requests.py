"""The S3 requests of one save (issue 37): counted by operation on the store's real boto3 client
(``helpers.s3_requests.RequestCounter``) against moto and SeaweedFS on 127.0.0.1.

The minimum a save needs (docs/s3.md, *Requests around a save and a restore*): one ``PutObject``
per data file (a multipart upload for a file above the part size), one conditional
``PutObject`` of the commit record, and for a manager's retention one ``ListObjectsV2`` of the
root plus the deletes of a retired step. On top of it a save makes one ``ListObjectsV2`` of its
location before any rank writes (is a record there, and which files of failed saves to remove
after the commit). Checked here:

- no ``GetObject`` of the record before the save, no ``HeadObject`` before the commit and no
  ``ListObjectsV2`` of the location after it;
- no ``HeadObject`` after a data upload where the server confirmed the CRC-32 it checked
  (SeaweedFS; moto checks no checksum, so a ``PutObject`` there is still followed by one);
- the manager cleans the root's stale multipart uploads once (its first save), not every save;
- its retention takes the record it just committed from the save, not from a ``GetObject``;
- the files of a failed save found before the save are still removed after the commit.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.s3_requests import RequestCounter, by_operation

from goodput_ckpt import CheckpointExistsError, CheckpointManager, CheckpointReader, CheckpointWriter
from goodput_ckpt.format.manifest import MANIFEST_NAME

MiB = 1 << 20
#: A small state: one data file below the part size, one PutObject.
SMALL = {"w": torch.arange(1 << 12, dtype=torch.float32), "step": 3}


def _verified_uploads(target) -> int:
    """HeadObject requests after each data PutObject: none where the server confirms the CRC."""
    return 0 if target.server == "seaweedfs" else 1


def _writer(target, prefix, counter, **kw):
    return CheckpointWriter(target.uri(prefix), chunk_size=5 * MiB, **target.options(session=counter.session(), **kw))


def test_dcp_save_makes_the_requests_of_its_layout(s3):
    counter = RequestCounter()
    dcp.save(SMALL, storage_writer=_writer(s3, "one", counter), no_dist=True)
    ops = by_operation(counter.take())
    assert ops == {
        "ListMultipartUploads": 1,  # the stale-upload clean-up of a writer of its own
        "ListObjectsV2": 1,  # before the save: a record there? files of failed saves?
        "PutObject": 2,  # the data file and the commit record
        **({"HeadObject": 1} if _verified_uploads(s3) else {}),
    }, ops


def test_a_multipart_file_needs_no_size_check_where_the_server_checked_its_parts(seaweed):
    counter = RequestCounter()
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32)}  # 12 MiB: three 5 MiB parts
    dcp.save(state, storage_writer=_writer(seaweed, "big", counter), no_dist=True)
    ops = by_operation(counter.take())
    assert ops.get("UploadPart") == 3 and ops.get("CompleteMultipartUpload") == 1, ops
    assert "HeadObject" not in ops, ops
    out = {"w": torch.zeros_like(state["w"])}
    dcp.load(out, storage_reader=CheckpointReader(seaweed.uri("big"), **seaweed.options()), no_dist=True)
    assert torch.equal(out["w"], state["w"])


def test_files_of_a_failed_save_are_removed_without_a_second_listing(s3):
    stale = "rank00000-00.0123456789ab.bin"  # what a save that failed before its commit leaves
    s3.client().put_object(Bucket=s3.bucket, Key=f"loc/{stale}", Body=b"old bytes")
    counter = RequestCounter()
    dcp.save(SMALL, storage_writer=_writer(s3, "loc", counter), no_dist=True)
    ops = by_operation(counter.take())
    assert ops.get("ListObjectsV2") == 1 and ops.get("DeleteObject") == 1, ops
    keys = s3.keys("loc/")
    assert f"loc/{stale}" not in keys and f"loc/{MANIFEST_NAME}" in keys, keys


def test_a_committed_record_is_never_overwritten(s3):
    """Without the HeadObject before the commit, the conditional PutObject alone refuses a record
    that appeared after the save's check (a writer that committed first)."""
    from goodput_ckpt import CheckpointExistsError
    from goodput_ckpt.storage import open_store

    store = open_store(s3.uri("race"), s3.options())
    store.put_commit_record(MANIFEST_NAME, b"first", replace=False)
    with pytest.raises(CheckpointExistsError):
        store.put_commit_record(MANIFEST_NAME, b"second", replace=False)
    assert store.read_small(MANIFEST_NAME) == b"first"


def test_a_steady_manager_save_makes_the_minimum_requests(s3):
    """Fails on the code before: it made one more request, a ``ListObjectsV2`` of the step's
    location before the save (6 on SeaweedFS where the minimum is 5)."""
    counter = RequestCounter()
    model = torch.nn.Linear(8, 4)
    mgr = CheckpointManager(
        s3.uri("root"), keep_last=2, async_save=False, timeline=False, **s3.options(session=counter.session())
    )
    try:
        per_save = []
        for step in range(1, 5):
            mgr.save(step, model=model)
            per_save.append(counter.take())
    finally:
        mgr.close()
    assert [by_operation(c).get("ListMultipartUploads", 0) for c in per_save] == [1, 0, 0, 0], per_save
    steady = per_save[3]  # step 4: retires step 2
    listed = sorted(where for (op, where), n in steady.items() if op == "ListObjectsV2" for _ in range(n))
    assert listed == ["root/"], listed  # the root, for retention; never the step's location
    assert by_operation(steady) == {
        "PutObject": 2,  # the data file and the commit record
        "ListObjectsV2": 1,  # the root, for retention
        "DeleteObject": 1,  # step 2's commit record, first and alone
        "DeleteObjects": 1,  # then step 2's data files, 1,000 a request
        **({"HeadObject": 1} if _verified_uploads(s3) else {}),
    }, steady
    assert sum(by_operation(steady).values()) - _verified_uploads(s3) == 5  # W + 4 at W = 1


def _leave_failed_save(target, prefix: str) -> list[str]:
    """What a save killed after its data uploads and before its commit leaves at ``prefix``: its
    real data file (a ``dcp.save`` whose record is then deleted). Returns the keys it left."""
    dcp.save({"w": torch.full((64,), 7.0)}, storage_writer=_writer(target, prefix, RequestCounter()), no_dist=True)
    target.client().delete_object(Bucket=target.bucket, Key=f"{prefix}/{MANIFEST_NAME}")
    return s3_keys(target, f"{prefix}/")


def s3_keys(target, prefix: str) -> list[str]:
    return sorted(target.keys(prefix))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_saves_files_at_the_step_are_removed_by_retention_not_committed(s3, async_save):
    """A job restarted after a save of step 3 died mid-save saves step 3 again (no restore in
    between, which would have removed the incomplete step): the new record lists only its own
    files, and retention after the commit (async: on its own thread) removes the dead save's
    ones; a file that is not a save's stays."""
    left = _leave_failed_save(s3, "root/step_00000003")
    assert left and all(k.endswith(".bin") for k in left), left
    s3.client().put_object(Bucket=s3.bucket, Key="root/step_00000003/notes.txt", Body=b"not the writer's")
    model = torch.nn.Linear(8, 4)
    mgr = CheckpointManager(s3.uri("root"), keep_last=2, async_save=async_save, timeline=False, **s3.options())
    try:
        mgr.save(3, model=model)
    finally:
        mgr.close()
    keys = s3_keys(s3, "root/step_00000003/")
    assert not set(left) & set(keys), keys
    assert "root/step_00000003/notes.txt" in keys and f"root/step_00000003/{MANIFEST_NAME}" in keys, keys
    record = s3.client().get_object(Bucket=s3.bucket, Key=f"root/step_00000003/{MANIFEST_NAME}")["Body"].read()
    committed = {f"root/step_00000003/{f}" for f in json.loads(record)["files"]}
    assert committed <= set(keys) and not committed & set(left), (committed, left)
    restored = torch.nn.Linear(8, 4)
    with torch.no_grad():
        restored.weight.zero_()
    mgr = CheckpointManager(s3.uri("root"), keep_last=2, async_save=False, timeline=False, **s3.options())
    try:
        assert mgr.restore(model=restored) == 3
    finally:
        mgr.close()
    assert torch.equal(restored.weight, model.weight)


def test_a_record_committed_elsewhere_at_the_step_is_still_refused(s3):
    """Another process commits step 5 after the manager listed its root: the manager's save of
    step 5 (no listing of the location before it writes) is refused at its conditional commit,
    removes its own files, and leaves the other record and its files as they were."""
    model = torch.nn.Linear(8, 4)
    mgr = CheckpointManager(s3.uri("root"), keep_last=2, async_save=False, timeline=False, **s3.options())
    try:
        mgr.save(1, model=model)  # the manager's listing of its root: no step 5
        dcp.save(
            {"w": torch.ones(16)}, storage_writer=_writer(s3, "root/step_00000005", RequestCounter()), no_dist=True
        )
        theirs = s3_keys(s3, "root/step_00000005/")
        record = s3.client().get_object(Bucket=s3.bucket, Key=f"root/step_00000005/{MANIFEST_NAME}")["Body"].read()
        with pytest.raises(CheckpointExistsError):
            mgr.save(5, model=model)
    finally:
        mgr.close()
    assert s3_keys(s3, "root/step_00000005/") == theirs
    after = s3.client().get_object(Bucket=s3.bucket, Key=f"root/step_00000005/{MANIFEST_NAME}")["Body"].read()
    assert after == record


def test_the_manager_cleans_the_stale_uploads_of_every_step_at_its_first_save(s3):
    """The clean-up the step writers no longer make: a killed save's multipart upload in another
    step's directory (which a step writer's own clean-up never looked at) is aborted once the
    manager's first save starts; uploads younger than ``stale_upload_age`` would stay."""
    client = s3.client()
    client.create_multipart_upload(Bucket=s3.bucket, Key="root/step_00000007/rank00000-00.0123456789ab.bin")
    assert s3.open_uploads()
    mgr = CheckpointManager(
        s3.uri("root"), keep_last=2, async_save=False, timeline=False, **s3.options(stale_upload_age=0)
    )
    try:
        mgr.save(1, model=torch.nn.Linear(8, 4))
    finally:
        mgr.close()
    assert s3.open_uploads() == []
