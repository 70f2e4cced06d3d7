"""CheckpointManager in one process: steps, retention, async consistency, errors, restore rules.

Multi-rank behaviour (per-rank state, FSDP2, kills, topology change) is in test_resume.py.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import warnings

import numpy as np
import pytest
import torch
from helpers.logs import logged_warnings
from helpers.manager_hooks import save_jobs_of, staging_of
from helpers.wait import wait_until
from torch import nn

from goodput_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from goodput_ckpt.errors import TopologyChangeError
from goodput_ckpt.format.manifest import MANIFEST_NAME


def _make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Counter:
    """A user stateful object (keyword argument) with plain and tensor state."""

    def __init__(self) -> None:
        self.n = 0
        self.hist = torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.hist.copy_(sd["hist"])


def test_save_restore_roundtrip_with_rng_stateful_and_extra(tmp_path):
    model, opt, sched = _make()
    _train(model, opt, sched, 3)
    counter = Counter()
    counter.n, counter.hist[:] = 5, torch.tensor([1.0, 2.0, 3.0])
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.restore(model=model, optimizer=opt) is None, "empty root: nothing to restore"
        mgr.save(7, model=model, optimizer=opt, scheduler=sched, counter=counter, extra={"epoch": 2, "tag": "a"})
        want = _params(model), sched.state_dict(), opt.state_dict()["state"][0]["exp_avg"].clone()
        draws = random.random(), np.random.rand(), torch.rand(3)
        mgr.wait()
        assert mgr.steps() == [7] and mgr.latest_step() == 7
        assert mgr.extra(7) == {"epoch": 2, "tag": "a"}

    model2, opt2, sched2 = _make(seed=99)
    counter2 = Counter()
    mgr = CheckpointManager(tmp_path)
    assert mgr.restore(model=model2, optimizer=opt2, scheduler=sched2, counter=counter2) == 7
    for k, v in want[0].items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert sched2.state_dict() == want[1]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], want[2])
    assert counter2.n == 5 and torch.equal(counter2.hist, torch.tensor([1.0, 2.0, 3.0]))
    assert (random.random(), np.random.rand()) == draws[:2] and torch.equal(torch.rand(3), draws[2]), "RNG restored"
    mgr.close()
    mgr.close()  # idempotent


def test_async_save_holds_the_state_of_its_step(tmp_path):
    """Training mutates parameters and optimizer state right after save() returns."""
    model, opt, sched = _make()
    _train(model, opt, sched, 2)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model=model, optimizer=opt, scheduler=sched)
    want = _params(model), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}, sched.state_dict()
    _train(model, opt, sched, 3)  # while the save may still be writing
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(123.0)
    mgr.wait()
    model2, opt2, sched2 = _make(seed=5)
    assert mgr.restore(model=model2, optimizer=opt2, scheduler=sched2) == 1
    for k, v in want[0].items():
        assert torch.equal(model2.state_dict()[k], v), k
    for k, v in want[1].items():
        assert torch.equal(opt2.state_dict()["state"][0][k], v), k
    assert sched2.state_dict() == want[2]
    mgr.close()


def test_one_process_saves_and_restores_show_no_missing_process_group_warning(tmp_path):
    """Without a process group the manager passes ``no_dist`` on purpose, from the caller's thread
    (sync save, restore) and from its save thread (async save): torch's "torch.distributed is
    disabled" warning would tell the user something is wrong. Only that message is silenced."""
    model, opt, sched = _make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what a user debugging warnings does; ours must still hold
        with CheckpointManager(tmp_path, async_save=True) as mgr:
            mgr.save(1, model=model, optimizer=opt)
            mgr.wait()
        with CheckpointManager(tmp_path, async_save=False) as mgr:
            mgr.save(2, model=model, optimizer=opt)
            assert mgr.restore(model=model, optimizer=opt) == 2
        warnings.warn("a user's own warning", UserWarning, stacklevel=1)
    shown = [str(w.message) for w in caught]
    assert not [m for m in shown if "torch.distributed is disabled" in m], shown
    assert "a user's own warning" in shown


def test_staging_buffers_are_reused_across_saves(tmp_path):
    model, opt, sched = _make()
    _train(model, opt, sched)
    mgr = CheckpointManager(tmp_path)
    mgr.save(0, model=model, optimizer=opt)
    mgr.wait()
    stager = staging_of(mgr).stager
    ptrs = {k: v.data_ptr() for k, v in stager.buffers.items()}
    mgr.save(1, model=model, optimizer=opt)
    mgr.wait()
    assert {k: v.data_ptr() for k, v in stager.buffers.items()} == ptrs
    assert stager.nbytes >= sum(p.numel() * 4 for p in model.parameters()) * 3
    mgr.close()


def test_retention_keeps_last_k_and_cleans_incomplete(tmp_path):
    model, opt, _ = _make()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    # An interrupted save (data, no manifest) older than the next commit, one newer, and junk.
    for step in (3, 50):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / "rank00000-00.0123456789ab.bin").write_bytes(b"x" * 100)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for step in (10, 20, 30, 40):
        mgr.save(step, model=model, optimizer=opt)
    mgr.wait()
    assert mgr.steps() == [30, 40]
    assert not (tmp_path / "step_00000010").exists(), "deleted directories disappear"
    assert not (tmp_path / "step_00000003").exists(), "incomplete and older than a commit: cleaned up"
    assert (tmp_path / "step_00000050").exists(), "incomplete but newer: maybe being written, kept"
    assert (tmp_path / "notes.txt").exists()
    # A restore picks the newest *complete* step and removes what is incomplete.
    model2, opt2, _ = _make(seed=1)
    assert mgr.restore(model=model2, optimizer=opt2) == 40
    assert not (tmp_path / "step_00000050").exists()
    mgr.close()


def test_newest_complete_is_never_deleted(tmp_path):
    model, opt, _ = _make()
    mgr = CheckpointManager(tmp_path, keep_last=1, async_save=False)
    mgr.save(100, model=model, optimizer=opt)
    mgr.save(5, model=model, optimizer=opt)  # a lower step (after a rollback): both survive
    assert mgr.steps() == [5, 100]
    mgr.save(200, model=model, optimizer=opt)
    assert mgr.steps() == [200]
    mgr.close()


def test_background_failure_is_logged_exposed_and_raised_at_wait(tmp_path, caplog):
    model, opt, _ = _make()
    (tmp_path / "step_00000002").write_text("a file where the step directory goes")  # a real failure
    seen = []
    mgr = CheckpointManager(tmp_path, on_error=lambda step, err: seen.append((step, err)))
    mgr.save(1, model=model, optimizer=opt)
    with caplog.at_level(logging.ERROR, logger="goodput_ckpt.manager"):
        mgr.save(2, model=model, optimizer=opt)  # returns: the failure happens in the background
        mgr.save(3, model=model, optimizer=opt)  # training goes on; this one succeeds
        wait_until(lambda: mgr.in_flight_step is None, what="the background saves to finish")
    assert mgr.steps() == [1, 3]
    assert isinstance(mgr.last_error, CheckpointError) and "not a directory" in str(mgr.last_error)
    assert seen and seen[0][0] == 2 and seen[0][1] is mgr.last_error
    assert any("step 2" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="not a directory"):
        mgr.wait()
    mgr.wait()  # reported once
    mgr.close()


def test_fail_fast_raises_at_next_save_and_close_raises_pending(tmp_path):
    model, opt, _ = _make()
    (tmp_path / "step_00000001").write_text("blocker")
    mgr = CheckpointManager(tmp_path, fail_fast=True)
    mgr.save(1, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="not a directory"):
        mgr.save(2, model=model, optimizer=opt)
    mgr.save(2, model=model, optimizer=opt)
    mgr.close()
    assert mgr.steps() == [2]

    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model=model, optimizer=opt)
    with pytest.raises(CheckpointError):
        mgr.close()
    mgr.close()  # closed anyway: no second raise
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(3, model=model, optimizer=opt)


def test_sync_save_errors_are_checkpoint_errors_not_dcp_exceptions(tmp_path):
    model, opt, _ = _make()
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, model=model, optimizer=opt)
    with pytest.raises(CheckpointExistsError):  # DCP's CheckpointException, unwrapped
        mgr.save(1, model=model, optimizer=opt)
    mgr.close()
    mgr = CheckpointManager(tmp_path, async_save=False, overwrite=True)
    mgr.save(1, model=model, optimizer=opt)
    mgr.close()


def test_restore_explicit_steps_and_missing_sections(tmp_path):
    model, opt, sched = _make()
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(1, model=model, optimizer=opt)
    mgr.save(2, model=model, optimizer=opt, scheduler=sched)
    mgr.wait()
    with pytest.raises(CheckpointNotFoundError):
        mgr.restore(9, model=model)
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "rank00000-00.0123456789ab.bin").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError):
        mgr.restore(3, model=model)
    with pytest.raises(CheckpointError, match="holds no state for scheduler="):
        mgr.restore(1, model=model, optimizer=opt, scheduler=sched)
    with logged_warnings("no dataloader state .* starts from its beginning"):  # issue 20
        mgr.restore(2, model=model, dataloader=_loader(0))
    model2, _, _ = _make(seed=3)
    assert mgr.restore(1, model=model2) == 1  # model only: fine
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), model.state_dict().values()))
    (tmp_path / "step_00000002" / MANIFEST_NAME).write_text("{garbled")
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(model=model, optimizer=opt, scheduler=sched)  # the newest is corrupt: said so
    mgr.close()


def test_dict_of_models_and_optimizers(tmp_path):
    g, og, sched = _make(0)
    d, od, _ = _make(1)
    _train(g, og, sched)
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, model={"gen": g, "disc": d}, optimizer={"gen": og, "disc": od})
    mgr.wait()
    g2, og2, _ = _make(5)
    d2, od2, _ = _make(6)
    assert mgr.restore(model={"gen": g2, "disc": d2}, optimizer={"gen": og2, "disc": od2}) == 4
    for a, b in ((g, g2), (d, d2)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(og2.state_dict()["state"][0]["exp_avg"], og.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(CheckpointError, match="holds models"):
        mgr.restore(model=g2)
    mgr.close()


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def _loader(num_workers: int, batch_size: int = 4):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        _Samples(),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
    )


def test_dataloader_position_and_worker_count_check(tmp_path):
    model, _, _ = _make()
    loader = _loader(0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, model=model, dataloader=loader)
    want = next(it)
    mgr.wait()

    fresh = _loader(0)
    assert mgr.restore(model=model, dataloader=fresh) == 3
    assert torch.equal(next(iter(fresh)), want), "resumes at the next batch"

    with pytest.raises(TopologyChangeError, match=r"num_workers 0 -> 2"):
        mgr.restore(model=model, dataloader=_loader(2))
    with pytest.raises(TopologyChangeError, match=r"batch_size 4 -> 8"):
        mgr.restore(model=model, dataloader=_loader(0, batch_size=8))
    mgr.close()
    mgr = CheckpointManager(tmp_path, allow_topology_change=True)
    other = _loader(2)
    with logged_warnings("dataloader differs"):
        assert mgr.restore(model=model, dataloader=other) == 3
    mgr.close()


class _Opaque:
    pass


class _UnsafeState:
    def state_dict(self):
        return {"obj": _Opaque()}

    def load_state_dict(self, sd):
        pass


def test_loading_never_unpickles_unsafe_values(tmp_path):
    model, _, _ = _make()
    mgr = CheckpointManager(tmp_path, async_save=False)
    with pytest.warns(UserWarning, match="weights_only"):
        mgr.save(1, model=model, thing=_UnsafeState())
    with pytest.raises(CheckpointError, match="weights_only=True"):
        mgr.restore(model=model, thing=_UnsafeState())

    class UnsafeLoader:
        def state_dict(self):
            return {"sampler": _Opaque()}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(CheckpointError, match="weights_only=True"):  # refused at save time
        mgr.save(2, model=model, dataloader=UnsafeLoader())
    mgr.close()


def test_argument_checks(tmp_path):
    model, opt, _ = _make()
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(TypeError, match="unknown option"):
        CheckpointManager(tmp_path, fsnyc=False)
    mgr = CheckpointManager(tmp_path, fsync=False)
    with pytest.raises(TypeError, match="reserved"):
        mgr.save(1, model=model, rng=Counter())
    with pytest.raises(TypeError, match="state_dict"):
        mgr.save(1, model=model, scheduler=object())
    with pytest.raises(TypeError, match="nn.Module"):
        mgr.save(1, model=opt)
    with pytest.raises(ValueError, match="JSON"):
        mgr.save(1, model=model, extra={"x": object()})
    with pytest.raises(ValueError, match="non-negative"):
        mgr.save(-1, model=model)
    mgr.save(1, model=model)
    mgr.close()
    assert CheckpointManager(tmp_path).steps() == [1]


def test_save_waits_for_the_previous_save(tmp_path):
    """Two saves never overlap: the second one starts after the first committed."""
    model, opt, _ = _make()
    mgr = CheckpointManager(tmp_path, keep_last=None)
    order = []
    jobs = save_jobs_of(mgr)
    real_write = jobs.write

    def write(job, staged, writer, *rest):
        order.append(("start", job.step, threading.current_thread().name))
        real_write(job, staged, writer, *rest)
        order.append(("end", job.step, os.path.exists(tmp_path / f"step_{job.step:08d}" / MANIFEST_NAME)))

    jobs.write = write
    for step in range(3):
        mgr.save(step, model=model, optimizer=opt)
    mgr.close()
    assert [o[:2] for o in order] == [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert all(o[2] for o in order if o[0] == "end")


def test_restore_applies_retention(tmp_path):
    """A run killed between a commit and its retention leaves one checkpoint too many; the next
    restore trims the root back to keep_last."""
    model, opt, _ = _make()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, model=model, optimizer=opt)
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        assert mgr.restore(model=model, optimizer=opt) == 4
        assert mgr.steps() == [3, 4]
        assert mgr.restore(3, model=model, optimizer=opt) == 3  # an explicit step deletes nothing
        assert mgr.steps() == [3, 4]


def test_a_synchronous_save_runs_dcp_save_with_the_collector_paused(tmp_path, monkeypatch):
    """A save the caller waits for runs ``dcp.save`` with the cyclic collector off
    (save_job.save_now): the save's own short-lived objects then set off no full collection.
    An async save's write beside training leaves it on; it is on again after either."""
    import gc

    import goodput_ckpt.manager.save_job as save_job

    seen: list[bool] = []
    real = save_job.dcp.save

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(save_job.dcp, "save", spy)
    model, opt, _ = _make()
    assert gc.isenabled()
    with CheckpointManager(tmp_path / "sync", async_save=False) as mgr:
        mgr.save(1, model=model, optimizer=opt)
    assert seen == [False] and gc.isenabled()
    with CheckpointManager(tmp_path / "async") as mgr:
        mgr.save(1, model=model, optimizer=opt)
        mgr.wait()
    assert seen == [False, True] and gc.isenabled()
