"""A restore that finds nothing says so (issue 32 §3): which root (redacted) it looked at,
whether it exists, and that training starts from step 0; before, ``restore()`` returned
``None`` in silence and a mistyped root trained from scratch."""

from __future__ import annotations

import logging

import torch

from goodput_ckpt import CheckpointManager


def _fresh_start_warnings(caplog, root, **opts) -> list[str]:
    model = torch.nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, logger="goodput_ckpt"), CheckpointManager(root, **opts) as mgr:
        caplog.clear()
        assert mgr.restore(model=model) is None
    return [r.getMessage() for r in caplog.records if "starts from step 0" in r.getMessage()]


def test_a_root_that_does_not_exist(tmp_path, caplog):
    (msg,) = _fresh_start_warnings(caplog, tmp_path / "typo")
    assert f"{tmp_path / 'typo'} does not exist" in msg and "training starts from step 0" in msg


def test_a_root_with_only_incomplete_saves(tmp_path, caplog):
    step = tmp_path / "run" / "step_00000007"
    step.mkdir(parents=True)
    (step / "rank00000-00.bin").write_bytes(b"x")  # a save killed before its commit
    (msg,) = _fresh_start_warnings(caplog, tmp_path / "run")
    assert "holds no complete checkpoint, only 1 incomplete save(s) (step 7" in msg and "does not exist" not in msg


def test_a_wrong_root_that_holds_other_files(tmp_path, caplog):
    (tmp_path / "run" / "data").mkdir(parents=True)
    (msg,) = _fresh_start_warnings(caplog, tmp_path / "run")
    assert "no step_* checkpoint (is it the right root?)" in msg


def test_two_tiers_name_the_persistent_root_and_the_local_directory(tmp_path, caplog):
    (msg,) = _fresh_start_warnings(caplog, tmp_path / "typo", local_dir=str(tmp_path / "local"))
    assert f"{tmp_path / 'typo'} does not exist" in msg and str(tmp_path / "local") in msg


def test_the_root_is_redacted(caplog):
    (msg,) = _fresh_start_warnings(caplog, "memory://user:s3cr3t@host/fresh-start-redact")
    assert "s3cr3t" not in msg and "memory://***@host/fresh-start-redact holds no checkpoint" in msg


def test_a_restore_that_finds_a_step_does_not_warn(tmp_path, caplog):
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, model=model)
    with caplog.at_level(logging.WARNING, logger="goodput_ckpt"), CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(model=model) == 1
    assert not [r for r in caplog.records if "starts from step 0" in r.getMessage()]
