"""Worker threads kept from one load to the next, shared by every load of the process.

Why: ``Thread.start`` returns only once the new thread has run, so a caller that starts its
workers per load waits for each of them to be scheduled, while the workers it started first
already hold the cores reading and hashing. On the 2-vCPU development machine at a load average
of about 20, a 144 MiB restore spent about 45 ms of its 116 ms starting its reader threads
(cProfile, 5 restores; docs/benchmarks.md, "Against the peers"). Threads kept between loads are
started once per process.

How a caller keeps its own bound: a pool's thread cap is only a ceiling (:data:`_CAP`); threads
are made when a task finds none idle, so the pool holds as many as the busiest moment needed. A
caller that wants ``n`` threads submits ``n`` tasks that each take work from the caller's own
queue (:func:`.read_runs.run_jobs`), so two loads at once share the threads without either
exceeding its own count.

What must not happen, and why it cannot:

- a deadlock of tasks waiting on tasks of the same pool: each pool's tasks wait only on another
  pool's (readers wait on hashers, hashers on nothing), and a task that itself needs a pool of
  its kind gets a private one (:meth:`WorkerPool.executor` sees it runs on a worker);
- a forked child using its parent's pool, whose threads it does not have (a dataloader worker):
  the pools are dropped in the child and made again on first use.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["HASHERS", "READERS", "WorkerPool"]

#: The most threads one pool may hold at once; a ceiling, not a count (threads start on demand).
_CAP = 256


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
