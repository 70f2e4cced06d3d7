"""Bounce buffers for direct I/O: reused while in use, released once idle."""

from __future__ import annotations

import mmap

import torch
import torch.distributed.checkpoint as dcp

from goodput_ckpt import CheckpointWriter
from goodput_ckpt.storage import direct_read, direct_write
from goodput_ckpt.storage.bounce import BouncePool


def _released(pool: BouncePool) -> None:
    """Wait for the armed release timer to run (it has no delay in these tests: it may be done)."""
    timer = pool.pending_release
    if timer is not None:
        timer.join(60)
        assert not timer.is_alive()


def test_buffers_are_reused_while_a_pool_is_busy():
    pool = BouncePool(mmap.PAGESIZE, 2, idle_seconds=0.0)
    a, b = pool.take(), pool.take()
    pool.give(b)
    assert pool.pending_release is None  # one buffer still in use: nothing is released
    assert pool.idle_bytes == mmap.PAGESIZE
    assert pool.take() is b  # the idle buffer is handed out again, not a new one
    pool.give(b)
    pool.give(a)
    _released(pool)
    assert pool.idle_bytes == 0


def test_idle_buffers_are_released_and_a_later_take_maps_a_new_one():
    pool = BouncePool(mmap.PAGESIZE, 4, idle_seconds=0.0)
    bufs = [pool.take() for _ in range(3)]
    for buf in bufs:
        pool.give(buf)
    _released(pool)
    assert pool.idle_bytes == 0 and all(buf.closed for buf in bufs)
    fresh = pool.take()
    fresh[:4] = b"abcd"  # usable
    pool.give(fresh)
    assert pool.release_idle() == mmap.PAGESIZE and fresh.closed


def test_no_more_than_keep_idle_buffers_and_none_released_without_a_limit():
    pool = BouncePool(mmap.PAGESIZE, 1, idle_seconds=None)
    a, b = pool.take(), pool.take()
    pool.give(a)
    pool.give(b)
    assert b.closed and not a.closed  # beyond ``keep``: unmapped at once
    assert pool.pending_release is None and pool.idle_bytes == mmap.PAGESIZE


def test_direct_io_pools_release_their_buffers_when_idle():
    for pool in (direct_write._POOL, direct_read._POOL):
        assert pool.idle_seconds is not None and pool.idle_seconds > 0


def test_a_direct_save_leaves_no_bounce_buffer_once_idle(tmp_path, monkeypatch):
    pool = BouncePool(direct_write.BOUNCE_BYTES, 8, idle_seconds=0.0)
    monkeypatch.setattr(direct_write, "_POOL", pool)
    state = {"w": torch.randn(6 << 20)}  # 24 MiB: 3 chunks, each through a bounce buffer
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "c"), direct_writes=True), no_dist=True)
    _released(pool)
    assert pool.idle_bytes == 0


def test_a_forked_child_releases_its_copy_of_the_idle_buffers():
    """A child forked while the release timer is armed (a data-loader worker) has no timer thread:
    its pool arms one of its own, so its copy of the idle buffers is released too."""
    import os

    pool = BouncePool(mmap.PAGESIZE, 2, idle_seconds=3600.0)
    pool.give(pool.take())
    parent_timer = pool.pending_release
    assert parent_timer is not None and parent_timer.is_alive()
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                timer = pool.pending_release
                code = 0 if timer is not None and timer.is_alive() and timer is not parent_timer else 2
                if timer is not None:
                    timer.cancel()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        parent_timer.cancel()
        parent_timer.join(60)
