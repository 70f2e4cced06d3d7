"""Async staging: save() returns before the parameters and optimizer states are copied; the next
optimizer step finishes the copy first, and any other in-place change in between fails the save.

The save thread is held on an event, so that these tests see a copy still pending when training
moves on (otherwise the background copy may win the race and hide a missing guard).
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import wait_until
from helpers.manager_hooks import hold_saves, staging_of
from torch import nn

from goodput_ckpt import CheckpointError, CheckpointManager


def _make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _forward_backward(model) -> None:
    model(torch.randn(8, 16)).square().mean().backward()


def _snapshot(model, opt):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
    )


def _trained_and_held(path, **kw):
    """A model and optimizer after one step (so AdamW has state), and a held manager."""
    model, opt = _make()
    _forward_backward(model)
    opt.step()
    opt.zero_grad()
    return (model, opt, *_held_manager(path, **kw))


def _held_manager(path, **kw):
    """A manager whose save thread first waits for ``release.set()``."""
    mgr = CheckpointManager(path, **kw)
    return mgr, hold_saves(mgr)


def _assert_restores(path, want) -> None:
    model, opt = _make(seed=9)
    with CheckpointManager(path) as mgr:
        assert mgr.restore(model=model, optimizer=opt) is not None
    got = _snapshot(model, opt)
    for k, v in want[0].items():
        assert torch.equal(got[0][k], v), k
    for i, s in want[1].items():
        for k, v in s.items():
            assert torch.equal(got[1][i][k], v), (i, k)


def test_the_next_optimizer_step_finishes_the_copy_first(tmp_path):
    model, opt, mgr, release = _trained_and_held(tmp_path)
    want = _snapshot(model, opt)
    mgr.save(1, model=model, optimizer=opt)
    pending = staging_of(mgr).guard.pending
    assert pending is not None and not pending.done, "the copy was left to later"
    model.eval()  # BatchNorm buffers are copied before save() returns; do not move them here
    _forward_backward(model)
    model.train()
    opt.step()  # the hook copies the parameters and states before AdamW changes them
    assert pending.done
    opt.zero_grad()
    _forward_backward(model)
    opt.step()
    release.set()
    mgr.wait()
    (record,) = [r for r in mgr.timeline if r["event"] == "save"]
    assert record["ok"] and record["guard_s"] > 0
    assert record["stall_s"] == pytest.approx(record["wait_s"] + record["stage_s"] + record["guard_s"])
    mgr.close()
    _assert_restores(tmp_path, want)


def test_buffers_a_forward_pass_updates_are_staged_before_save_returns(tmp_path):
    model, opt, mgr, release = _trained_and_held(tmp_path)
    want = _snapshot(model, opt)
    mgr.save(1, model=model, optimizer=opt)
    _forward_backward(model)  # train mode: BatchNorm updates running_mean/var in place
    assert not torch.equal(model[1].running_mean, want[0]["1.running_mean"])
    opt.step()
    release.set()
    mgr.close()
    _assert_restores(tmp_path, want)


@pytest.mark.parametrize("when", ["before the copy", "after the copy, step first", "after the copy, commit first"])
def test_an_in_place_change_outside_the_optimizer_fails_the_save_by_name(tmp_path, when):
    """Not through opt.step(), so nothing holds it back. Before the copy, the copy's own check
    sees it. After the copy (its version bump landing after that check, as for an op that ran
    during the copy), the last comparison does: the optimizer step's pre-hook, or the save thread
    just before its commit. Either way the save commits nothing and the next one is unaffected."""
    model, opt, mgr, release = _trained_and_held(tmp_path)
    mgr.save(1, model=model, optimizer=opt)
    if when != "before the copy":
        pending = staging_of(mgr).guard.pending
        pending.finish()  # as the save thread does: every piece copied, no change seen yet
        pending.result()
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    if when == "after the copy, step first":
        _forward_backward(model)
        opt.step()  # the pre-hook confirms: the change is seen now
    release.set()
    with pytest.raises(CheckpointError, match=r"0\.weight changed in place after save\(\) returned"):
        mgr.wait()
    assert mgr.steps() == [] and not (tmp_path / "step_00000001" / "manifest.json").exists()
    opt.zero_grad()
    want = _snapshot(model, opt)
    mgr.save(2, model=model, optimizer=opt)  # the next save is unaffected
    mgr.close()
    _assert_restores(tmp_path, want)


def test_a_save_commits_without_waiting_for_the_training_loop(tmp_path):
    """No optimizer step after save(): the save thread's own last comparison lets it commit."""
    model, opt, mgr, release = _trained_and_held(tmp_path)
    want = _snapshot(model, opt)
    mgr.save(1, model=model, optimizer=opt)
    release.set()
    wait_until(lambda: mgr.in_flight_step is None, 60, interval=0.02, what="the save to land")
    assert mgr.steps() == [1] and not staging_of(mgr).guard.pending.confirmed
    mgr.close()
    _assert_restores(tmp_path, want)


def test_wait_staged_makes_other_in_place_changes_safe(tmp_path):
    model, opt, mgr, release = _trained_and_held(tmp_path)
    want = _snapshot(model, opt)
    mgr.save(1, model=model, optimizer=opt)
    mgr.wait_staged()
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    release.set()
    mgr.close()
    _assert_restores(tmp_path, want)


def test_async_staging_off_copies_everything_before_save_returns(tmp_path):
    model, opt, mgr, release = _trained_and_held(tmp_path, async_staging=False)
    want = _snapshot(model, opt)
    mgr.save(1, model=model, optimizer=opt)
    assert staging_of(mgr).guard.pending.done
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    release.set()
    mgr.close()
    _assert_restores(tmp_path, want)


def test_parameters_of_no_passed_optimizer_are_staged_at_once(tmp_path):
    """Without optimizer=, nothing would hold the parameters back: they are copied in save()."""
    model, _ = _make()
    mgr, release = _held_manager(tmp_path)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mgr.save(1, model=model)
    assert staging_of(mgr).guard.pending.done
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    release.set()
    mgr.close()
    model2, _ = _make(seed=4)
    with CheckpointManager(tmp_path) as mgr2:
        mgr2.restore(model=model2)
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_close_removes_the_optimizer_hooks(tmp_path):
    model, opt = _make()
    _forward_backward(model)
    opt.step()
    hooks_before = len(opt._optimizer_step_pre_hooks)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model=model, optimizer=opt)
    mgr.save(2, model=model, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == hooks_before + 1, "one hook per optimizer, not per save"
    mgr.close()
    assert len(opt._optimizer_step_pre_hooks) == hooks_before


def test_close_after_a_save_timed_out_does_not_wait_for_it(tmp_path):
    """A save stuck past timeout_s (a hung store or collective) makes close() raise promptly
    instead of waiting on the stuck thread."""
    model, opt, mgr, release = _trained_and_held(tmp_path, timeout_s=0.5)
    mgr.save(1, model=model, optimizer=opt)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="still running after"):
        mgr.close()
    assert time.monotonic() - t0 < 10
    release.set()  # let the held thread go (its save then runs and commits on its own)
