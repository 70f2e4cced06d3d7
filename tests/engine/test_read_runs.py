"""``run_jobs`` on the process's kept reader threads (``engine/worker_pool.py``): a later load
starts no thread, a load never runs more readers than it asked for, the first error stops the
jobs not started, a read that itself loads does not wait on itself, and a forked child loads on
threads of its own."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from goodput_ckpt.engine.read_runs import run_jobs
from goodput_ckpt.engine.worker_pool import READERS


def _load(jobs, threads, read=None, verify=None):
    """Run ``jobs``; returns the reader threads seen and the jobs done, in order."""
    seen: set[threading.Thread] = set()
    done: list[list[int]] = []
    lock = threading.Lock()
    caller = threading.current_thread()

    def default_read(task):
        with lock:
            seen.add(threading.current_thread())
        return task

    def job_done(job):
        assert threading.current_thread() is caller
        done.append(job)

    run_jobs(jobs, threads=threads, read=read or default_read, verify=verify, job_done=job_done)
    return seen, done


def test_a_later_load_reuses_the_reader_threads():
    jobs = [[i] for i in range(32)]
    _, done = _load(jobs, threads=4)
    assert sorted(done) == jobs
    kept = {t for t in threading.enumerate() if t.name.startswith("goodput-read")}
    used: set[threading.Thread] = set()
    for _ in range(10):
        seen, done = _load(jobs, threads=4)
        assert sorted(done) == jobs
        used |= seen
    # Threads started per load would be 10 or more new ones. A few may still start: a worker
    # counts itself idle just after its last task's result, so a load right after another can
    # find none idle for a moment.
    assert len(used - kept) <= 3, f"{len(used - kept)} new reader threads in 10 loads"


def test_a_load_never_runs_more_readers_than_it_asked_for():
    _load([[i] for i in range(16)], threads=8)  # the pool now holds 8 threads or more
    running = peak = 0
    lock = threading.Lock()

    def read(task):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.005)
        with lock:
            running -= 1
        return task

    _, done = _load([[i] for i in range(24)], threads=2, read=read)
    assert len(done) == 24 and peak <= 2, peak


@pytest.mark.parametrize("where", ["read", "verify"])
def test_the_first_error_is_raised_and_stops_the_jobs_not_started(where):
    read_jobs: list[int] = []

    def read(task):
        read_jobs.append(task)
        if where == "read" and task == 0:
            raise ValueError("broken read")
        return task

    def verify(task, got):
        if task == 0:
            raise ValueError("broken hash")

    with pytest.raises(ValueError, match="broken"):
        _load([[i] for i in range(10)], threads=1, read=read, verify=verify)
    assert read_jobs == [0], read_jobs


def test_runs_hash_beside_the_reads_and_a_bad_hash_in_a_run_fails_the_load():
    hashed: list[tuple[int, str]] = []
    lock = threading.Lock()

    def verify(task, got):
        with lock:
            hashed.append((task, threading.current_thread().name))
        if task == 21:
            raise ValueError("bad chunk 21")

    jobs = [[10 * j + t for t in range(4)] for j in range(3)]
    _, done = _load(jobs[:2], threads=2, verify=verify)
    assert sorted(t for t, _ in hashed) == sorted(sum(jobs[:2], [])) and len(done) == 2
    assert any(name.startswith("goodput-hash") for _, name in hashed)
    with pytest.raises(ValueError, match="bad chunk 21"):
        _load(jobs, threads=3, verify=verify)


def test_a_read_that_loads_does_not_wait_on_itself():
    def read(task):
        inner, done = _load([[task, k] for k in range(4)], threads=256)
        assert len(done) == 4
        return task

    _, done = _load([[i] for i in range(4)], threads=4, read=read)
    assert len(done) == 4


def _slow_read(task):
    time.sleep(0.005)
    return task


def _child_load(out) -> None:
    _, done = _load([[i] for i in range(8)], threads=2)
    out.put(len(done))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_loads_on_threads_of_its_own():
    _load([[i] for i in range(32)], threads=8, read=_slow_read)  # the parent's pool has idle threads
    assert READERS._pool is not None
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_load, args=(out,))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child's load hung on its parent's threads")
    assert child.exitcode == 0 and out.get(timeout=5) == 8
