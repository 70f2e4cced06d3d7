"""ReusableStager: staging into CPU buffers kept across saves, and the guard that protects them."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointError, CheckpointReader, CheckpointWriter
from goodput_ckpt.manager.staging.stager import ReusableStager


def _state():
    """Not :func:`helpers.make_state`: what a stager must copy (nested dicts, a non-contiguous
    view, a list of dicts of plain values), kept small."""
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.randn(32), "view": torch.randn(32, 64).t()},
        "optim": {"step": torch.tensor(3.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "n": 7,
    }


def test_buffers_are_reused_and_hold_the_values_at_stage_time():
    sd = _state()
    stager = ReusableStager()
    first = stager.stage(sd)
    stager.release()
    ptrs = {k: first["model"][k].data_ptr() for k in sd["model"]}
    for t in sd["model"].values():
        t.add_(1.0)  # training moves on
    second = stager.stage(sd)
    assert {k: second["model"][k].data_ptr() for k in sd["model"]} == ptrs, "the same buffers are reused"
    for k, t in sd["model"].items():
        assert torch.equal(second["model"][k], t) and second["model"][k].is_contiguous()
    expected = {k: t.clone() for k, t in sd["model"].items()}
    for t in sd["model"].values():
        t.mul_(2.0)  # mutations after stage() never reach the staged copy
    sd["optim"]["groups"][0]["lr"] = 0.5
    for k in sd["model"]:
        assert torch.equal(second["model"][k], expected[k])
    assert second["optim"]["groups"][0]["lr"] == 0.1 and second["optim"]["groups"][0]["betas"] == (0.9, 0.99)
    assert second["n"] == 7
    assert stager.nbytes == sum(t.numel() * t.element_size() for t in [*sd["model"].values(), sd["optim"]["step"]])
    stager.release()


def test_changed_shapes_get_new_buffers_and_dropped_keys_free_theirs():
    stager = ReusableStager()
    staged = stager.stage({"a": torch.zeros(10), "b": torch.zeros(1000)})
    old_a = staged["a"].data_ptr()
    stager.release()
    staged = stager.stage({"a": torch.ones(20)})
    stager.release()
    assert staged["a"].shape == (20,) and torch.equal(staged["a"], torch.ones(20))
    assert staged["a"].data_ptr() != old_a
    assert stager.nbytes == 20 * 4, "the buffer of the removed key was dropped"


class _WatchedCondition(threading.Condition):
    """A Condition that tells when a thread starts waiting on it (a real event, not a guess)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):  # wait_for calls wait only when its predicate is false
        self.waiting.set()
        return super().wait(timeout)


def test_second_stage_waits_for_release():
    stager = ReusableStager(timeout_s=30)
    sd = {"w": torch.zeros(1000)}
    stager.stage(sd)
    assert stager.busy
    stager._cond = cond = _WatchedCondition()
    done = threading.Event()

    def second():
        stager.stage(sd)
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert cond.waiting.wait(30), "the second stage() never waited"
    assert not done.is_set(), "stage() must not overwrite buffers a save still holds"
    stager.release()
    t.join(10)
    assert done.is_set()
    stager.release()


def test_stage_times_out_with_a_clear_error():
    stager = ReusableStager(timeout_s=0.2)
    stager.stage({"w": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="still holds the staging buffers"):
        stager.stage({"w": torch.zeros(4)})
    stager.release()
    stager.stage({"w": torch.zeros(4)})  # usable again
    stager.release()
    with pytest.raises(ValueError):
        ReusableStager(timeout_s=0)


def test_as_the_async_stager_of_dcp_async_save(tmp_path):
    stager = ReusableStager()
    sd = {"w": torch.randn(256, 256), "step": 5}
    expected = sd["w"].clone()
    fut = dcp.async_save(sd, storage_writer=CheckpointWriter(tmp_path / "c"), async_stager=stager)
    sd["w"].zero_()  # right after async_save returned
    fut.result()
    stager.release()
    dest = {"w": torch.empty(256, 256), "step": 0}
    dcp.load(dest, storage_reader=CheckpointReader(tmp_path / "c"))
    assert torch.equal(dest["w"], expected) and dest["step"] == 5
    stager.close()
    assert stager.nbytes == 0


def test_skipped_keys_are_not_copied_and_keep_their_buffers():
    """An incremental save's unchanged tensors (``skip``, by DCP's flattened key) stay the live
    tensors in the staged copy, and their buffers stay kept for the next full save (issue 40)."""
    sd = _state()
    stager = ReusableStager()
    stager.stage(sd)
    stager.release()
    kept = stager.buffers[("model", "w")]
    staged, later = stager.stage_deferred(sd, None, skip={"model.w"})
    assert staged["model"]["w"].data_ptr() == sd["model"]["w"].data_ptr(), "not copied"
    assert staged["model"]["b"].data_ptr() != sd["model"]["b"].data_ptr(), "the others are"
    assert stager.buffers[("model", "w")] is kept
    stager.release()
    full = stager.stage(sd)
    assert full["model"]["w"].data_ptr() == kept.data_ptr() and torch.equal(full["model"]["w"], sd["model"]["w"])
