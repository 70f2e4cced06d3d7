"""Retention beside the saves (goodput_ckpt/manager/background_retention.py, issue 37).

- The next save does not wait for a slow retention: the fault proxy in front of moto holds the
  retention's first delete unanswered; the next async save is staged, written and committed
  while it is still held (ordering: the held step's commit record is still stored once that
  save's job is done).
- A save of a step a pending retention may delete (a rollback to an older step number) waits
  until the retention is over (ordering: it returns only after the held delete was released).
- A run after an older commit spares a newer step whose save this manager started, even where
  the root holds newer steps still (a rollback's lineage), which it would otherwise delete.
- A crash in the middle of a retention: tests/manager/test_retention_s3.py (the deletions are
  the same functions, in the same order).
"""

from __future__ import annotations

import threading

import torch
from helpers.manager_hooks import retention_of, save_jobs_of
from helpers.records import empty_record
from helpers.wait import wait_until

from goodput_ckpt import CheckpointManager
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.manager.background_retention import BackgroundRetention
from goodput_ckpt.manager.retention import scan_steps
from goodput_ckpt.manager.step_layout import step_dir_name
from goodput_ckpt.storage import open_store


def _record(moto, step: int) -> str:
    return f"root/{step_dir_name(step)}/{MANIFEST_NAME}"


def _held_manager(moto, proxy) -> CheckpointManager:
    """An async manager through the proxy whose retention after step 2 is held at its first
    delete (step 1's commit record) until ``proxy.release()``; step 2's save job is done."""
    proxy.stall_s = 300
    mgr = CheckpointManager(moto.uri("root"), keep_last=1, async_save=True, **moto.options(endpoint_url=proxy.url))
    model = torch.nn.Linear(8, 8)
    mgr.save(1, model=model)
    mgr.wait()
    proxy.add("stall", op="DeleteObject", times=1)
    mgr.save(2, model=model)
    wait_until(lambda: proxy.log.faults, what="retention's held delete")
    return mgr


def test_a_save_does_not_wait_for_a_slow_retention(moto, proxy):
    mgr = _held_manager(moto, proxy)
    try:
        mgr.save(3, model=torch.nn.Linear(8, 8))
        save_jobs_of(mgr).finish_previous(report=True)  # step 3's save job: written, committed
        keys = moto.keys("root/")
        assert _record(moto, 3) in keys
        assert _record(moto, 1) in keys  # the retention that deletes it is still held
        assert retention_of(mgr).pending()
        proxy.release()
        mgr.wait()  # waits for the retention
        assert mgr.steps() == [3]
    finally:
        proxy.release()
        mgr.close()


def test_a_save_of_a_step_retention_may_delete_waits_for_it(moto, proxy, monkeypatch):
    mgr = _held_manager(moto, proxy)
    draining = threading.Event()
    drain = BackgroundRetention.drain

    def spy(self):
        draining.set()
        return drain(self)

    monkeypatch.setattr(BackgroundRetention, "drain", spy)
    released = threading.Event()
    seen: dict[str, bool] = {}

    def rollback_save():
        mgr.save(0, model=torch.nn.Linear(8, 8))  # older than step 2: a pending run could delete it
        seen["released"] = released.is_set()

    t = threading.Thread(target=rollback_save)
    try:
        t.start()
        assert draining.wait(60)
        released.set()
        proxy.release()
        t.join(120)
        assert seen == {"released": True}
        mgr.wait()
        assert mgr.steps() == [0, 2]  # the run after 0 keeps it and the newest complete
    finally:
        proxy.release()
        t.join(120)
        mgr.close()


def test_a_run_after_an_older_commit_spares_a_newer_save(tmp_path):
    for s in (2, 3, 4):  # 4: a newer step of an earlier lineage, kept as the newest complete
        d = tmp_path / step_dir_name(s)
        d.mkdir()
        (d / "rank00000-00.0123456789ab.bin").write_bytes(b"data")
        (d / MANIFEST_NAME).write_bytes(empty_record())
    root = open_store(str(tmp_path))
    bg = BackgroundRetention(root, keep_last=1, timeout_s=60)
    try:
        bg.before_save(3)  # this manager's save of 3 began before the run after 2 is applied
        bg.submit(2)
        bg.drain()
        assert scan_steps(root).complete == [2, 3, 4] and bg.runs == 1
        bg.submit(3)  # its own run judges it: the newest complete (4) and 3 stay
        bg.drain()
        assert scan_steps(root).complete == [3, 4]
    finally:
        bg.close()
