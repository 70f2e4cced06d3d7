"""What an incremental save references and what it writes (dcp/incremental.py, dcp/references_write.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.incremental import frozen_model, load_model, save_steps
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.dcp.incremental import IncrementalTracker
from goodput_ckpt.errors import CheckpointError, as_checkpoint_error, find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest


def _manifest(root, step):
    with open(os.path.join(root, f"step_{step:08d}", MANIFEST_NAME), "rb") as f:
        return parse_manifest(f.read())


def _base_files(manifest):
    return {name: f.base for name, f in manifest.files.items()}


def test_an_unchanged_frozen_base_is_referenced_not_written(tmp_path):
    model = frozen_model(base=256)
    _, writers = save_steps(str(tmp_path), model, [1, 2, 3])
    frozen = sum(p.numel() * p.element_size() for p in model[0].parameters())
    assert writers[0].bytes_written > frozen and writers[0].bytes_referenced == 0
    for w in writers[1:]:
        assert w.bytes_referenced == frozen and w.bytes_written < frozen // 10
    assert _manifest(tmp_path, 3).bases() == {"step_00000001"}  # always the step that holds the bytes


def test_an_in_place_change_of_a_frozen_tensor_is_written(tmp_path):
    model = frozen_model()
    tracker, _ = save_steps(str(tmp_path), model, [1])
    with torch.no_grad():
        model[0].weight[3, 3] += 1.0  # bumps the version counter
    _, writers = save_steps(str(tmp_path), model, [2], tracker=tracker)
    assert writers[0].bytes_referenced == model[0].bias.numel() * 4  # only the bias is unchanged
    loaded = load_model(str(tmp_path / "step_00000002"))
    assert torch.equal(loaded["0.weight"], model[0].weight)


def test_a_trainable_parameter_is_never_referenced(tmp_path):
    """A write through ``.data`` bypasses the version counter: trainable parameters, which such
    code updates, are always written."""
    model = frozen_model()
    tracker, _ = save_steps(str(tmp_path), model, [1])
    state = {"model": model.state_dict(), "step": 2}
    plan = tracker.plan(state, [model], location="step_00000002")
    assert set(plan.reusable) == {"model.0.weight", "model.0.bias"}
    model[1].weight.data.add_(1.0)  # no version bump: still written, because it is trainable
    w = CheckpointWriter(str(tmp_path / "step_00000002"), reuse=plan)
    dcp.save(state, storage_writer=w)
    assert torch.equal(load_model(str(tmp_path / "step_00000002"))["1.weight"], model[1].weight)


def test_every_nth_save_is_full(tmp_path):
    model = frozen_model()
    save_steps(str(tmp_path), model, [1, 2, 3, 4, 5], full_every=3)
    bases = [_manifest(tmp_path, s).bases() for s in (1, 2, 3, 4, 5)]
    assert bases == [set(), {"step_00000001"}, {"step_00000001"}, set(), {"step_00000004"}]


def test_a_save_that_did_not_commit_is_not_a_base(tmp_path):
    model = frozen_model()
    tracker, _ = save_steps(str(tmp_path), model, [1])
    tracker.plan({"model": model.state_dict()}, [model], location="step_00000002")  # never committed
    save_steps(str(tmp_path), model, [3], tracker=tracker)
    assert _manifest(tmp_path, 3).bases() == {"step_00000001"}


def test_a_fresh_tensor_at_every_save_is_written(tmp_path):
    """Tensors the state builds anew (RNG rows): the previous one is held by the tracker, so a new
    one cannot get its address and pass for it."""
    tracker = IncrementalTracker(100)
    for step in (1, 2, 3):
        state = {"x": torch.ones(4096)}
        plan = tracker.plan(state, [], location=f"step_{step:08d}")
        assert not plan.reusable
        w = CheckpointWriter(str(tmp_path / f"step_{step:08d}"), reuse=plan)
        dcp.save(state, storage_writer=w)
        tracker.committed(plan)
        assert w.bytes_referenced == 0
        del state, plan, w  # the allocator may hand the next tensor this one's memory


def test_saving_a_step_again_never_references_its_own_files(tmp_path):
    model = frozen_model()
    tracker, _ = save_steps(str(tmp_path), model, [1])
    state = {"model": model.state_dict(), "step": 1}
    plan = tracker.plan(state, [model], location="step_00000001")
    w = CheckpointWriter(str(tmp_path / "step_00000001"), reuse=plan, overwrite=True)
    dcp.save(state, storage_writer=w)  # the old files are removed first: nothing to reference
    assert w.bytes_referenced == 0 and _manifest(tmp_path, 1).bases() == set()
    loaded = load_model(str(tmp_path / "step_00000001"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_an_unstaged_item_that_would_be_written_fails_the_save(tmp_path):
    """An async save leaves the unchanged tensors unstaged (their live memory in the staged copy):
    if the writer would write one after all, the save fails naming it, rather than writing bytes
    that training may have changed since staging (issue 40)."""
    model = frozen_model()
    tracker, _ = save_steps(str(tmp_path), model, [1])
    state = {"model": model.state_dict(), "step": 2}
    plan = tracker.plan(state, [model], location="step_00000002")
    plan.unstaged = frozenset(plan.reusable) | {"model.1.weight"}  # trainable: never referenced
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "step_00000002"), reuse=plan))
    err = find_checkpoint_error(as_checkpoint_error(caught.value, "saving"))
    assert isinstance(err, CheckpointError) and err.key == "model.1.weight", err
    plan = tracker.plan(state, [model], location="step_00000003")
    plan.unstaged = frozenset(plan.reusable)  # what the manager passes: referenced, never read
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "step_00000003"), reuse=plan))
    assert _manifest(tmp_path, 3).bases() == {"step_00000001"}
