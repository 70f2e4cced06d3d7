"""Injected S3 faults: retries recover from transient ones; persistent ones fail cleanly and fast.

A loopback proxy (``tests/helpers/s3.py``) sits between the client and moto and, by rule, answers 503
SlowDown or 500, resets connections (before forwarding, or after the server did the work so
that only the response is lost), cuts response bodies short, or stalls. A clean failure means:
a ``CheckpointError`` naming the object and the cause, within the retry budget; no manifest; no
completed object made of missing parts; and no multipart upload left open.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.errors import checkpoint_error
from helpers.s3 import FaultProxy
from helpers.s3_roundtrip import CHUNK, load, s3_state, save
from helpers.trees import assert_tree_equal, zeros_like

from goodput_ckpt import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)

#: Quick failure detection for the tests: 1 s without a byte is a stall.
FAST = {"read_timeout": 1.0, "connect_timeout": 1.0}
#: A small budget, so persistent faults fail within seconds.
SHORT = {**FAST, "max_attempts": 4, "retry_time_limit": 3.0}


@pytest.fixture
def via_proxy(moto, proxy):
    """The test's bucket, reached through the fault proxy."""
    proxy.stall_s = 5.0
    return type(moto)("moto", proxy.url, moto.bucket)


def test_transient_faults_are_retried(moto, proxy, via_proxy):
    rules = [
        proxy.add("503", op="UploadPart", times=2),  # throttled
        proxy.add("500", op="CreateMultipartUpload", times=1),
        proxy.add("reset", op="UploadPart", after=1, times=1),  # connection reset, nothing done
        proxy.add("stall", op="UploadPart", after=2, times=1),  # no answer: the read timeout
        proxy.add("500", op="CompleteMultipartUpload", times=1),
        proxy.add("reset_after", op="CompleteMultipartUpload", times=1),  # completed, answer lost
        proxy.add("reset_after", op="PutObject", key_contains="manifest", times=1),  # committed, answer lost
        proxy.add("503", op="GetObject", key_contains="manifest", times=1),
        proxy.add("cut_body", op="GetObject", key_contains=".bin", times=1),  # resumes mid-body
        proxy.add("stall_body", op="GetObject", key_contains=".bin", times=1),
    ]
    state = s3_state()
    save(state, via_proxy, "retry", **FAST, retry_time_limit=30.0)
    assert_tree_equal(load(state, via_proxy, "retry", **FAST, retry_time_limit=30.0), state)
    assert [r.fired for r in rules] == [r.times for r in rules], proxy.log.faults
    assert moto.open_uploads() == []


def test_random_faults_everywhere(moto, proxy, via_proxy):
    """15% of all requests fail, in every way at once; the save and the load still succeed."""
    for action in ("503", "500", "reset", "reset_after", "cut_body"):
        proxy.add(action, probability=0.03)
    state = s3_state(5)
    save(state, via_proxy, "random", **FAST, retry_time_limit=60.0, max_attempts=20)
    assert_tree_equal(load(state, via_proxy, "random", **FAST, retry_time_limit=60.0, max_attempts=20), state)
    assert len(proxy.log.faults) > 0 and moto.open_uploads() == []


@pytest.mark.parametrize(
    "action, op, cause",
    [
        ("503", "UploadPart", r"SlowDown \(HTTP 503\)"),
        ("stall", "UploadPart", "ReadTimeoutError"),
        ("reset", "CreateMultipartUpload", "ConnectionClosedError|EndpointConnectionError|ConnectionError"),
        ("500", "CompleteMultipartUpload", r"InternalError \(HTTP 500\)"),
    ],
)
def test_persistent_data_faults_fail_cleanly(moto, proxy, via_proxy, action, op, cause):
    proxy.add(action, op=op)
    start = time.monotonic()
    with pytest.raises(BaseException) as info:
        save(s3_state(), via_proxy, "fail", **SHORT)
    elapsed = time.monotonic() - start
    err = checkpoint_error(info)
    assert err.path and "/fail/rank00000-00." in err.path and err.path.endswith(".bin"), err.path
    assert re.search(cause, str(err)), str(err)
    assert "gave up after" in str(err) or "another part" in str(err)
    # Within the budget: 3 s of retries, plus timeouts and the aborts.
    assert elapsed < 20, elapsed
    assert moto.keys("fail/") == [], "no manifest and no completed object"
    assert moto.open_uploads() == [], "the multipart upload was aborted"


def test_persistent_commit_fault_leaves_no_manifest(moto, proxy, via_proxy):
    proxy.add("503", op="PutObject", key_contains="manifest.json")
    with pytest.raises(BaseException) as info:
        save(s3_state(), via_proxy, "nocommit", **SHORT)
    err = checkpoint_error(info)
    assert err.path.endswith("nocommit/manifest.json") and "SlowDown" in str(err)
    keys = moto.keys("nocommit/")
    assert keys and not any(k.endswith("manifest.json") for k in keys)
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        CheckpointReader(moto.uri("nocommit"), **moto.options()).read_metadata()


def test_persistent_read_faults_fail_cleanly(moto, proxy, via_proxy):
    state = s3_state()
    save(state, moto, "readfail")
    for action in ("reset", "stall_body"):
        proxy.clear()
        proxy.add(action, op="GetObject", key_contains=".bin")
        start = time.monotonic()
        with pytest.raises(BaseException) as info:
            load(state, via_proxy, "readfail", **SHORT)
        err = checkpoint_error(info)
        assert time.monotonic() - start < 20
        assert (
            isinstance(err, CheckpointError) and "/readfail/rank00000-00." in str(err) and "gave up after" in str(err)
        )
    # Once the faults stop, the checkpoint reads fine: nothing was damaged.
    proxy.clear()
    assert_tree_equal(load(state, via_proxy, "readfail"), state)


def test_failure_on_one_file_stops_the_others(moto, proxy, via_proxy):
    """Several files per rank: one file's persistent failure aborts every upload of the save."""
    proxy.add("503", op="UploadPart", key_contains="-01.")
    state = {f"t{i}": torch.full((CHUNK // 4 + 1000,), float(i)) for i in range(4)}
    with pytest.raises(BaseException) as info:
        writer = CheckpointWriter(
            via_proxy.uri("multi"), chunk_size=CHUNK, files_per_rank=3, **via_proxy.options(**SHORT)
        )
        dcp.save(state, storage_writer=writer)
    assert "-01." in checkpoint_error(info).path
    assert moto.open_uploads() == [] and not any(k.endswith("manifest.json") for k in moto.keys("multi/"))
    # Every upload slot came back: the same writer saves again once the faults stop.
    assert writer.store.slots()._value == writer.store.config.max_concurrency
    proxy.clear()
    dcp.save(state, storage_writer=writer)
    dest = zeros_like(state)
    dcp.load(dest, storage_reader=CheckpointReader(via_proxy.uri("multi"), **via_proxy.options()))
    assert all(torch.equal(dest[k], state[k]) for k in state)


@pytest.mark.parametrize("checksums", [True, False])
def test_body_damaged_in_transit(seaweed, checksums):
    """A part damaged on its way to the server (one bit flipped by the proxy).

    With CRC-32s (the default) SeaweedFS refuses it (BadDigest), the part is sent again and the
    checkpoint is intact. Without them the body is only covered by the SHA-256 in the signature,
    which this server does not check against the body: the damage is stored, and only the blake3
    check on load catches it, naming the chunk.
    """
    target = seaweed
    proxy = FaultProxy(seaweed.url)
    try:
        rule = proxy.add("corrupt", op="UploadPart", times=1)
        via = type(target)("seaweedfs", proxy.url, target.bucket)
        state = s3_state(2)
        save(state, via, "crc", checksums=checksums)
        assert rule.fired == 1
        if checksums:
            assert proxy.count("UploadPart") == 5  # 4 parts, one sent twice
            assert_tree_equal(load(state, target, "crc"), state)
        else:
            with pytest.raises(BaseException) as info:
                load(state, target, "crc")
            err = checkpoint_error(info)
            assert isinstance(err, CorruptCheckpointError) and err.key and "crc/rank00000-00." in err.path
    finally:
        proxy.stop()
