"""Retention decides from references, not step numbers (issue 40): a job rolled back that saves
lower step numbers references the higher step it saved last, and a retention cut short between
two deletions leaves every complete step loadable (manager/step_references.py)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.lora import adapter_optimizer, lora_model, train_step
from helpers.trees import assert_tree_equal

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import parse_manifest
from goodput_ckpt.manager import retention
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.storage import open_store
from goodput_ckpt.tools import verify_checkpoint


def _bases(root: str, step: int) -> set[str]:
    with open(os.path.join(root, step_dir_name(step), "manifest.json"), "rb") as f:
        return parse_manifest(f.read()).bases()


def _rolled_back_root(root: str) -> tuple[torch.nn.Module, dict[int, dict]]:
    """Steps saved in the order 10, 3, 4, 20, 21 (a full save every 3rd): 3 and 4 reference 10,
    21 references 20. No retention while saving (``keep_last=None``)."""
    model = lora_model(n=64, layers=2)
    opt = adapter_optimizer(model)
    states = {}
    with CheckpointManager(root, keep_last=None, incremental=3, async_save=False) as mgr:
        for i, step in enumerate([10, 3, 4, 20, 21]):
            train_step(model, opt, i, n=64)
            mgr.save(step, model=model, optimizer=opt)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert _bases(root, 3) == _bases(root, 4) == {step_dir_name(10)}
    assert _bases(root, 21) == {step_dir_name(20)} and not _bases(root, 10) and not _bases(root, 20)
    return model, states


def _complete(root: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "manifest.json")))


def test_a_base_with_a_larger_step_number_outlives_its_kept_referrer(tmp_path):
    root = str(tmp_path / "root")
    _, states = _rolled_back_root(root)
    # Step 4 just committed (kept as such); keep_last=1 keeps 21, which references 20.
    retention.apply_retention(open_store(root), committed=4, keep_last=1)
    assert _complete(root) == [4, 10, 20, 21]  # 10 stays for 4; only 3 went
    for step in (4, 10, 20, 21):
        assert verify_checkpoint(os.path.join(root, step_dir_name(step))).ok, step
    fresh = lora_model(n=64, layers=2, seed=7)
    with CheckpointManager(root, keep_last=None) as mgr:
        assert mgr.restore(4, model=fresh, optimizer=adapter_optimizer(fresh)) == 4
    assert_tree_equal(fresh.state_dict(), states[4])


class Killed(BaseException):
    """Stands for a SIGKILL between two deletions: nothing after it runs."""


@pytest.mark.parametrize("after", [1, 2])
def test_a_retention_cut_short_leaves_every_complete_step_loadable(tmp_path, monkeypatch, after):
    """keep_last=2 after step 21: 3, 4 and 10 go. The referrers go before their base, so a kill
    after any deletion leaves no complete step without its base (numbers first: 10 went first,
    and 3 and 4 were left complete and unloadable)."""
    root = str(tmp_path / "root")
    _, states = _rolled_back_root(root)
    real = retention.delete_step
    done: list[int] = []

    def delete_then_die(store, step, files):
        real(store, step, files)
        done.append(step)
        if len(done) == after:
            raise Killed

    monkeypatch.setattr(retention, "delete_step", delete_then_die)
    with pytest.raises(Killed):
        retention.apply_retention(open_store(root), committed=21, keep_last=2)
    assert 10 not in done
    for step in _complete(root):
        assert verify_checkpoint(os.path.join(root, step_dir_name(step))).ok, step
    monkeypatch.setattr(retention, "delete_step", real)
    retention.apply_retention(open_store(root), committed=21, keep_last=2)  # the next retention finishes
    assert _complete(root) == [20, 21]
    fresh = lora_model(n=64, layers=2, seed=7)
    with CheckpointManager(root, keep_last=2) as mgr:
        assert mgr.restore(model=fresh, optimizer=adapter_optimizer(fresh)) == 21
    assert_tree_equal(fresh.state_dict(), states[21])
