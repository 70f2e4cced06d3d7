"""Worker threads kept from one load or save to the next, shared by every load and save of the
process.

Why: ``Thread.start`` returns only once the new thread has run, so a caller that starts its
workers per load waits for each of them to be scheduled, while the workers it started first
already hold the cores reading and hashing. On the 2-vCPU development machine at a load average
of about 20, a 144 MiB restore spent about 45 ms of its 116 ms starting its reader threads
(cProfile, 5 restores; docs/benchmarks.md, "Against the peers"). Threads kept between loads are
started once per process.

How a caller keeps its own bound: a pool's thread cap is only a ceiling (:data:`_CAP`); threads
are made when a task finds none idle, so the pool holds as many as the busiest moment needed. A
caller that wants ``n`` threads submits ``n`` runners that each take work from the caller's own
list (:func:`run_bounded`), so two loads or saves at once share the threads without either
exceeding its own count.

What must not happen, and why it cannot:

- a deadlock of tasks waiting on tasks of the same pool: each pool's tasks wait only on another
  pool's (readers wait on hashers; hashers and writers on none of these), and a task that itself needs a pool of
  its kind gets a private one (:meth:`WorkerPool.executor` sees it runs on a worker);
- a forked child using its parent's pool, whose threads it does not have (a dataloader worker):
  the pools are dropped in the child and made again on first use.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

__all__ = ["HASHERS", "READERS", "WRITERS", "WorkerPool", "run_bounded"]

R = TypeVar("R")

#: The most threads one pool may hold at once; a ceiling, not a count (threads start on demand).
_CAP = 256
#: Seconds between the caller's checks that its runners are still there while it waits (a runner
#: that never ran: the interpreter is shutting its pools down).
_POLL_S = 1.0


class WorkerPool:
    """One kind of worker (readers, hashers): a lazily made :class:`ThreadPoolExecutor` kept for
    the process's life, its threads named ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        _all.append(self)

    def on_worker(self) -> bool:
        """Whether the calling thread is one of this pool's workers."""
        return threading.current_thread().name.startswith(self._prefix)

    def executor(self, threads: int) -> tuple[ThreadPoolExecutor, bool]:
        """The executor to submit to, and whether it is private to this call (the caller then
        shuts it down): private when the caller runs on one of this pool's own workers, where
        waiting on the shared one could wait on itself."""
        if self.on_worker():
            return ThreadPoolExecutor(max(1, threads), thread_name_prefix=self._prefix + "-nested"), True
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_CAP, thread_name_prefix=self._prefix)
            return self._pool, False

    def _forget(self) -> None:
        """In a forked child: the parent's threads are not here; make a new pool on first use."""
        self._lock = threading.Lock()
        self._pool = None


_all: list[WorkerPool] = []


def _after_fork_in_child() -> None:
    for pool in _all:
        pool._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: Threads that read a load's jobs (:func:`.read_runs.run_jobs`).
READERS = WorkerPool("goodput-read")
#: Threads that hash a task while its reader reads the next one.
HASHERS = WorkerPool("goodput-hash")
#: Threads that hash and write a save's chunks (:func:`.hashed_write.write_hashed_files`).
WRITERS = WorkerPool("goodput-write")


def run_bounded(
    pool: WorkerPool,
    count: int,
    threads: int,
    task: Callable[[int], R],
    done: Callable[[int, R], None],
) -> None:
    """Run ``task(0) ... task(count - 1)`` on at most ``threads`` of ``pool``'s workers, taken
    in order; ``done(i, result)`` is called in the calling thread as each finishes (never two at
    once).

    Raises:
        The first error of any task (or of ``done``): the tasks not started yet are not started,
        and the running ones finish before it is raised.
    """
    if count <= 0:
        return
    order = iter(range(count))
    taking = threading.Lock()
    stop = threading.Event()
    finished: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()

    def runner() -> None:
        while not stop.is_set():
            with taking:
                i = next(order, None)
            if i is None:
                return
            try:
                result = task(i)
            except BaseException as e:  # handed to the caller, which raises it
                stop.set()
                finished.put((i, None, e))
                return
            finished.put((i, result, None))

    executor, private = pool.executor(threads)
    runners: list[Future[None]] = []
    try:
        runners = [executor.submit(runner) for _ in range(min(max(1, threads), count))]
        left = count
        while left:
            try:
                i, result, err = finished.get(timeout=_POLL_S)
            except queue.Empty:
                if all(f.done() for f in runners) and finished.empty():
                    broken = next((f.exception() for f in runners if f.exception() is not None), None)
                    raise RuntimeError(f"the worker threads stopped with {left} tasks not run") from broken
                continue
            if err is not None:
                raise err
            done(i, result)
            left -= 1
    finally:
        stop.set()  # tasks not started yet are not run for nothing
        wait(runners)
        if private:
            executor.shutdown(wait=True)
