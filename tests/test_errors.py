"""goodput_ckpt/errors.py: as_checkpoint_error and find_checkpoint_error on real DCP failures.

Issue 35, item 3: a failure inside ``dcp.load`` that is not ours (torch's own planner) becomes a
CheckpointError whose message is one line naming the rank's own error, not the text of torch's
``CheckpointException`` (a traceback per rank); the whole exception stays on ``__cause__``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.errors import CheckpointError, CorruptCheckpointError, as_checkpoint_error, find_checkpoint_error


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors") / "ck")
    dcp.save({"w": torch.ones(4, 2)}, storage_writer=CheckpointWriter(path), no_dist=True)
    return path


def _torch_planner_failure(path: str) -> CheckpointException:
    with pytest.raises(CheckpointException) as info:  # torch's DefaultLoadPlanner: "Size mismatch ..."
        dcp.load({"w": torch.zeros(3, 3)}, storage_reader=CheckpointReader(path), no_dist=True)
    return info.value


def test_a_foreign_failure_becomes_one_line_naming_the_rank_and_its_error(ckpt):
    exc = _torch_planner_failure(ckpt)
    assert str(exc).startswith("CheckpointException ranks:") and "Traceback" in str(exc)
    err = as_checkpoint_error(exc, "loading step 7")
    assert type(err) is CheckpointError and err.__cause__ is exc
    text = str(err)
    assert "\n" not in text and text.startswith("loading step 7 failed on rank 0: ValueError: Size mismatch")
    assert "torch.Size([4, 2])" in text and "for w" in text


def test_ours_inside_is_returned_as_it_is_and_found_through_the_failures(ckpt):
    def refuse(*_a, **_k):
        raise CorruptCheckpointError("chunk 0 of w does not match its hash", key="w")

    reader = CheckpointReader(ckpt)
    reader.read_data = refuse
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4, 2)}, storage_reader=reader, no_dist=True)
    found = find_checkpoint_error(info.value)
    assert isinstance(found, CorruptCheckpointError) and found.key == "w"
    err = as_checkpoint_error(info.value, "loading")
    assert err is found and err.__cause__ is info.value and str(err) == "chunk 0 of w does not match its hash"


def test_a_plain_exception_keeps_its_own_text():
    err = as_checkpoint_error(OSError(28, "No space left on device"), "saving step 3")
    assert str(err) == "saving step 3 failed: OSError: [Errno 28] No space left on device"
    assert isinstance(err.__cause__, OSError)
