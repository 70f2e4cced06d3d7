"""``save(step)`` of a step that is already committed is refused at the call, on every rank
alike, with ``CheckpointExistsError`` (issue 32 §3); before, the save failed in the background
and surfaced only at ``close()``. ``overwrite=True`` still replaces it."""

from __future__ import annotations

import json

import duplicate_job
import pytest
import torch
from helpers.dist import run_ranks

from goodput_ckpt import CheckpointExistsError, CheckpointManager


@pytest.mark.parametrize("async_save", [True, False])
def test_a_duplicate_save_raises_at_the_call(tmp_path, async_save):
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, model=model)
        with pytest.raises(CheckpointExistsError, match="step 1 already has a committed checkpoint.*overwrite=True"):
            mgr.save(1, model=model)
        mgr.save(2, model=model)
        mgr.wait()  # nothing failed in the background
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:  # a new process: found by listing
        with pytest.raises(CheckpointExistsError):
            mgr.save(2, model=model)
        assert mgr.last_error is None


def test_a_failed_save_can_be_retried(tmp_path):
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ValueError):  # fails before anything is written
            mgr.save(1, model=model, extra={"x": object()})
        mgr.save(1, model=model)
        assert mgr.steps() == [1]


@pytest.mark.multiproc
def test_every_rank_refuses_alike(tmp_path):
    run_ranks(duplicate_job.duplicate_saves, 2, str(tmp_path), report_dir=tmp_path / "report")
    results = [json.loads((tmp_path / f"dup-rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["same_manager"] and "step 1 already has a committed checkpoint" in r["same_manager"]
        assert r["listed"] and "step 2" in r["listed"]
        assert r["local_tier"] and "local tier" in r["local_tier"]
        assert r["overwrite"] == "ok"
    assert results[0] == results[1]
