"""Where a save's tensor items are resolved: in the writer threads, beside the I/O (dcp/write_sources.py)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from goodput_ckpt import CheckpointReader, CheckpointWriter
from goodput_ckpt.errors import CheckpointError
from goodput_ckpt.format.manifest import MANIFEST_NAME


class _Recording(DefaultSavePlanner):
    """Records the thread each item is resolved on, and may resolve one key to a wrong tensor."""

    def __init__(self, wrong: str | None = None) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}
        self.wrong = wrong

    def resolve_data(self, write_item):
        self.threads[write_item.index.fqn] = threading.current_thread().name
        data = super().resolve_data(write_item)
        return torch.zeros(3, dtype=torch.float64) if write_item.index.fqn == self.wrong else data


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(300 + i, generator=g) for i in range(40)} | {"step": 7, "name": "run"}


def test_tensor_items_are_resolved_by_the_writer_threads(tmp_path):
    state = _state()
    planner = _Recording()
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "c"), thread_count=2), planner=planner, no_dist=True)
    main = threading.main_thread().name
    tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert tensors <= set(planner.threads)
    assert all(planner.threads[k] != main for k in tensors)  # none in the save's serial part
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    dcp.load(out, storage_reader=CheckpointReader(str(tmp_path / "c"), verify=True), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in tensors) and out["step"] == 7 and out["name"] == "run"


def test_a_tensor_that_does_not_match_its_plan_fails_the_save_with_its_name(tmp_path):
    # dcp.save wraps a rank's error in its CheckpointException, which carries ours with its message.
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_state(), storage_writer=CheckpointWriter(str(tmp_path / "c")), planner=_Recording("w5"), no_dist=True)
    ((err, _trace),) = caught.value.failures.values()  # (the exception, its traceback)
    assert isinstance(err, CheckpointError)
    assert "tensor 'w5': data (torch.float64, 24 bytes) does not match its plan (torch.float32, 1220 bytes)" in str(err)
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()  # nothing committed
