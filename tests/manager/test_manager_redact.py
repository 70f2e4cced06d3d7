"""Credentials in a manager's root URL reach no message, log record or manifest (issue 16 item 16).

Before: the closed-manager error quoted the root as given, and the writer handed it to DCP as
``checkpoint_id``, which torch logs with every save and records in ``StorageMeta`` (our manifest).
"""

from __future__ import annotations

import logging

import pytest
import torch

from goodput_ckpt import CheckpointError, CheckpointManager, CheckpointReader
from goodput_ckpt.storage import open_store

SECRET = "s3cr3t-Pa55"


def test_manager_messages_logs_and_manifest_never_hold_url_credentials(caplog):
    root = f"memory://user:{SECRET}@host/run-redact"
    model = torch.nn.Linear(4, 2)
    mgr = CheckpointManager(root, async_save=False)
    with caplog.at_level(logging.DEBUG):
        mgr.save(1, model=model)
        mgr.wait()
        assert CheckpointReader(mgr.step_uri(1)).checkpoint_id == mgr.step_uri(1).replace(f"user:{SECRET}", "***")
    assert mgr.steps() == [1]
    manifest = open_store(mgr.step_uri(1)).read_small("manifest.json")
    assert manifest and SECRET.encode() not in manifest
    mgr.close()
    with pytest.raises(CheckpointError) as info:
        mgr.save(2, model=model)
    assert SECRET not in str(info.value)
    # fsspec's memory filesystem has no credentials: to it the user info is a path, and its own
    # debug log says so. Ours and torch's DCP logger are what must never quote them.
    logged = [r.getMessage() for r in caplog.records if not r.name.startswith("fsspec")]
    assert any("step_00000001" in m for m in logged)  # torch's DCP logger names the checkpoint
    assert not [m for m in logged if SECRET in m]
