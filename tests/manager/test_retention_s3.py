"""Retention on S3 (issue 37): the deletes of a step are batched, and a process killed in the
middle of a retention leaves every committed step readable.

- Requests are counted on the store's real boto3 client (``helpers.s3_requests.RequestCounter``)
  against a real SeaweedFS server: one ``DeleteObject`` for the commit record, alone and first,
  then ``DeleteObjects`` of 1,000 data files each.
- The crash: a subprocess applies retention through the fault proxy in front of moto, which
  holds one delete request unanswered; the process is SIGKILLed while it waits (once before the
  commit record is deleted, once between the record and the data files). Every step whose
  record survived then verifies, and a restarted manager restores the newest bit-exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.records import empty_record
from helpers.s3_requests import RequestCounter, by_operation
from helpers.wait import wait_until

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.manager.retention import apply_retention, scan_steps
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools import verify_checkpoint


def _plant(target, step: int, files: int) -> None:
    """A step of ``files`` data files and a commit record (S3 commits atomically, so the record's
    content is only read for its references)."""
    client = target.client()
    names = [f"rank{r:05d}-00.0123456789ab.bin" for r in range(files)] + [MANIFEST_NAME]

    def put(n: str) -> None:
        body = empty_record() if n == MANIFEST_NAME else b"d"
        client.put_object(Bucket=target.bucket, Key=f"root/{step_dir_name(step)}/{n}", Body=body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, names))


def test_retention_of_a_step_batches_its_deletes(seaweed):
    _plant(seaweed, 1, 2100)
    _plant(seaweed, 2, 1)
    counter = RequestCounter()
    order: list[str] = []
    counter.session().events.register(
        "before-parameter-build.s3.*", lambda model, params, **_: order.append(f"{model.name} {params.get('Key', '')}")
    )
    root = open_store(seaweed.uri("root"), seaweed.options(session=counter.session()))
    apply_retention(root, committed=2, keep_last=1)
    assert seaweed.keys("root/step_00000001/") == []
    assert len(seaweed.keys("root/step_00000002/")) == 2
    ops = by_operation(counter.take())
    # Listing the root (3 pages of 2,103 keys), the kept step's record (for its references), the
    # victim's record, then 2,100 data files in 3 batches.
    assert ops == {"DeleteObject": 1, "DeleteObjects": 3, "ListObjectsV2": 3, "GetObject": 1}
    deletes = [o for o in order if o.startswith("Delete")]
    assert deletes[0] == f"DeleteObject root/step_00000001/{MANIFEST_NAME}", deletes
    # At 16,384 ranks: 1 + ceil(16,384 / 1,000) = 18 requests to delete a step.


WORKER = """
import sys
from goodput_ckpt.manager.retention import apply_retention
from goodput_ckpt.storage import open_store
uri, url = sys.argv[1], sys.argv[2]
opts = {"endpoint_url": url, "addressing_style": "path", "region": "us-east-1", "read_timeout": 600, "max_attempts": 1}
apply_retention(open_store(uri, opts), committed=3, keep_last=1)
print("done", flush=True)
"""


def _save_steps(target) -> dict[int, torch.Tensor]:
    values = {}
    mgr = CheckpointManager(target.uri("root"), keep_last=None, async_save=False, **target.options())
    try:
        for step in (1, 2, 3):
            values[step] = torch.arange(4096, dtype=torch.float32) * step
            model = torch.nn.Linear(64, 64)
            with torch.no_grad():
                model.weight.copy_(values[step].reshape(64, 64))
            mgr.save(step, model=model)
    finally:
        mgr.close()
    return values


@pytest.mark.parametrize("held", ["DeleteObject", "POSTBucket"], ids=["before-the-record", "after-the-record"])
def test_a_retention_killed_midway_leaves_every_committed_step_readable(moto, proxy, tmp_path, held):
    values = _save_steps(moto)
    proxy.stall_s = 600
    proxy.add("stall", op=held, times=1)
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, moto.uri("root"), proxy.url], stdout=log, stderr=log, env=os.environ
    )
    try:
        wait_until(lambda: proxy.log.faults or proc.poll() is not None, timeout=120, what="the held delete")
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        log.close()
    root = open_store(moto.uri("root"), moto.options())
    scan = scan_steps(root)
    # Victims go newest first (retention.deletion_order): the kill came during step 2's, so
    # steps 1 and 3 are whole; step 2 is complete (its record not yet deleted) or incomplete
    # (record gone, data left).
    assert sorted(scan.files) == [1, 2, 3] and {1, 3} <= set(scan.complete)
    assert (2 in scan.complete) == (held == "DeleteObject")
    for step in scan.complete:
        report = verify_checkpoint(moto.uri(f"root/{step_dir_name(step)}"), **moto.options())
        assert report.ok, [p.message for p in report.problems]
    model = torch.nn.Linear(64, 64)
    mgr = CheckpointManager(moto.uri("root"), keep_last=1, async_save=False, **moto.options())
    try:
        assert mgr.restore(model=model) == 3
    finally:
        mgr.close()
    assert torch.equal(model.weight.detach().reshape(-1), values[3])
    assert sorted(scan_steps(root).files) == [3]  # the restore cleaned up what the kill left
