"""Restoring an incremental step from S3 (issue 40): the requests it costs beyond a full step's.

Counted on the store's real boto3 client (``helpers.s3_requests.RequestCounter``) against a real
SeaweedFS server. A restore of a root whose newest step references a base beyond ``keep_last``
reads the newest commit record once, in the clean-up (which finds the base referenced and spares it:
manager/step_references.py stops there), and hands it to the load (manager/chain.py); no other
step's record is read, and one ``HEAD``: the
referenced file's size, checked before any data byte is read (docs/format.md: the base's files
are not in this location's listing).
"""

from __future__ import annotations

import torch
from helpers.lora import adapter_optimizer, lora_model, train_step
from helpers.s3_requests import RequestCounter
from helpers.trees import assert_tree_equal

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.manager.step_layout import step_dir_name


def test_an_incremental_restore_reads_one_record_and_heads_only_the_referenced_file(seaweed):
    torch.manual_seed(0)
    model = lora_model(n=64, layers=2)
    opt = adapter_optimizer(model)
    uri = seaweed.uri("job")
    with CheckpointManager(uri, keep_last=2, async_save=False, incremental=True, **seaweed.options()) as mgr:
        for step in range(1, 5):
            train_step(model, opt, step, n=64)
            mgr.save(step, model=model, optimizer=opt)
    kept = {k.split("/")[1] for k in seaweed.keys("job/step_")}
    assert kept == {step_dir_name(1), step_dir_name(3), step_dir_name(4)}  # the base is spared

    counter = RequestCounter()
    fresh = lora_model(n=64, layers=2, seed=1)
    fresh_opt = adapter_optimizer(fresh)
    with CheckpointManager(uri, keep_last=2, **seaweed.options(session=counter.session())) as mgr:
        assert mgr.restore(model=fresh, optimizer=fresh_opt) == 4
    assert_tree_equal(fresh.state_dict(), model.state_dict())
    counts = counter.take()
    heads = [k for (op, k) in counts if op == "HeadObject"]
    assert len(heads) == 1 and heads[0].startswith(f"job/{step_dir_name(1)}/"), counts
    records = {k: n for (op, k), n in counts.items() if op == "GetObject" and k.endswith(MANIFEST_NAME)}
    # The newest record is read once: by the clean-up, which hands it to the load (before: twice);
    # steps 3 and 1 are not read.
    assert records == {f"job/{step_dir_name(4)}/{MANIFEST_NAME}": 1}, records
    # Still kept: the base, referenced by a kept step.
    assert {k.split("/")[1] for k in seaweed.keys("job/step_")} == kept
