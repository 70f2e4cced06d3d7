"""DeferredCopies: staging copies finished after save() returned, by any thread, with a change check."""

from __future__ import annotations

import threading

import pytest
import torch

from goodput_ckpt import CheckpointError
from goodput_ckpt.manager.staging import deferred_copy
from goodput_ckpt.manager.staging.deferred_copy import DeferredCopies
from goodput_ckpt.manager.staging.stager import ReusableStager


def _copies(n: int = 6, size: int = 300_000):
    srcs = [torch.randn(size) for _ in range(n)]
    return [(f"t{i}", s, torch.empty_like(s), s) for i, s in enumerate(srcs)]


def test_pieces_are_shared_by_threads_and_every_byte_lands(monkeypatch):
    monkeypatch.setattr(deferred_copy, "PIECE_BYTES", 64 << 10)  # many pieces per tensor
    copies = _copies()
    later = DeferredCopies(copies)
    assert len(later._pieces) > 6 * 10 and not later.done
    threads = [threading.Thread(target=later.finish) for _ in range(3)]
    for t in threads:
        t.start()
    spent = later.finish(blocking_caller=True)
    for t in threads:
        t.join()
    assert later.done
    later.result()
    for _, src, dst, _ in copies:
        assert torch.equal(src, dst)
    # The helpers may finish every piece before the caller enters (then it blocked 0 s); either
    # way the blocked time is exactly what the blocking caller spent, never the helpers' time.
    assert later.blocked_seconds() == spent
    assert later.finish(blocking_caller=True) == 0.0, "nothing left: returns at once"


def test_non_contiguous_sources_are_copied_whole():
    src = torch.randn(64, 32).t()
    dst = torch.empty(src.shape)
    later = DeferredCopies([("v", src, dst, src)])
    assert len(later._pieces) == 1
    later.finish()
    later.result()
    assert torch.equal(src, dst)


def test_nothing_to_copy_is_done_at_once():
    later = DeferredCopies([])
    assert later.done and later.finish() == 0.0 and later.blocked_seconds() == 0.0
    later.result()


def test_a_source_changed_before_the_copies_finished_fails_them_by_name():
    copies = _copies(3)
    later = DeferredCopies(copies)
    copies[1][1].add_(1.0)  # an in-place change the manager's hook did not hold back
    later.finish()
    assert later.done
    with pytest.raises(CheckpointError, match=r"t1 changed in place after save\(\) returned") as info:
        later.result()
    assert info.value.key == "t1"


def test_a_change_after_the_training_thread_confirmed_is_fine():
    """What the optimizer step does after its pre-hook confirmed the copies."""
    copies = _copies(2)
    later = DeferredCopies(copies)
    assert not later.confirmed
    later.finish()
    later.confirm()
    copies[0][1].add_(1.0)  # the step: the save thread does not compare again after confirm()
    later.check_before_commit()
    later.result()
    assert not torch.equal(copies[0][1], copies[0][2])


@pytest.mark.parametrize("last", ["training thread", "save thread"])
def test_a_change_that_lands_after_the_copy_fails_them_at_the_last_comparison(last):
    """An in-place op still running while its tensor was copied bumps the version counter only
    when it returns, after the copy's own check: the last comparison sees it, whether the
    training thread confirms first or the save thread gets to its commit first."""
    copies = _copies(2)
    later = DeferredCopies(copies)
    later.finish()  # the save thread copied everything and found no change
    later.result()
    copies[0][1].add_(1.0)  # ...the op returns now
    if last == "training thread":
        later.confirm()  # the optimizer's step pre-hook
    else:
        later.check_before_commit()
        later.confirm()  # no second comparison: the first one stands
    with pytest.raises(CheckpointError, match=r"t0 changed in place after save\(\) returned") as info:
        later.result()
    assert info.value.key == "t0"


def test_a_watch_tensor_stands_for_its_source():
    """A DTensor's in-place ops bump the wrapper's version counter, not its local shard's: the
    wrapper is watched instead of the shard that is copied."""
    src, watch = torch.randn(1000), torch.zeros(1)
    later = DeferredCopies([("dt.weight", src, torch.empty_like(src), watch)])
    later.finish()
    watch.add_(1.0)
    later.confirm()
    with pytest.raises(CheckpointError, match="dt.weight changed in place"):
        later.result()


def test_a_failed_copy_is_reported_by_result_not_by_finish():
    src = torch.randn(10)
    later = DeferredCopies([("bad", src, torch.empty(3), src)])  # copy_ cannot broadcast 10 into 3
    later.finish(blocking_caller=True)  # never raises: a training thread calls it from a hook
    with pytest.raises(CheckpointError, match="copying the state into the staging buffers failed"):
        later.result()


def test_stage_deferred_copies_only_what_defer_selects():
    deferred_src, now_src = torch.randn(1000), torch.randn(1000)
    sd = {"p": deferred_src, "buf": now_src, "n": 3}
    stager = ReusableStager()
    staged, later = stager.stage_deferred(sd, lambda t: t.data_ptr() == deferred_src.data_ptr())
    assert torch.equal(staged["buf"], now_src), "copied before stage_deferred returned"
    assert not later.done and [name for name, _, _ in later._sources] == ["p"]
    now_src.add_(1.0)  # a forward pass updating a buffer after save() returned: already staged
    later.finish()
    later.result()
    assert torch.equal(staged["p"], deferred_src)
    assert not torch.equal(staged["buf"], now_src)
    stager.release()
    staged, later = stager.stage_deferred(sd, None)
    assert later.done and torch.equal(staged["p"], deferred_src) and torch.equal(staged["buf"], now_src)
    stager.release()


def test_ctrl_c_during_a_hooked_copy_reaches_the_training_loop(monkeypatch):
    """A KeyboardInterrupt in the training thread's copy is passed on (training stops, as the
    user asked) and fails the copies; it is not swallowed like a copy failure."""
    later = DeferredCopies(_copies(2))

    def interrupted(dst, src):
        raise KeyboardInterrupt

    monkeypatch.setattr(deferred_copy, "_copy_on_one_core", interrupted)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: interrupted(self, src))
    with pytest.raises(KeyboardInterrupt):
        later.finish(blocking_caller=True)
    monkeypatch.undo()
    later.finish()
    with pytest.raises(CheckpointError, match="KeyboardInterrupt|staging buffers failed"):
        later.result()
