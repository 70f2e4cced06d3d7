"""Running a load's read jobs: bounded threads, verification beside the reads, first error wins.

A job is a list of tasks (:mod:`.read_plan`) that one thread reads in order: a single task on
stores that serve ranges in parallel, or a run of one file's tasks on stores that stream files
(mounted volumes). A run of several tasks hashes each task on a helper thread while it reads the
next, so its stream always has a read in flight: a direct read of a FUSE file keeps nothing in
flight otherwise, and hashing 16 MiB between reads would leave the stream idle for as long. At
most one hash per run is outstanding, so a run holds at most two tasks' worth of unverified
bytes, and a run's task counts as done only once its hash has been checked.

The threads are the process's kept readers and hashers (:mod:`.worker_pool`): a load submits
``threads`` runners that take its jobs in order from its own list, so it never uses more than
``threads`` readers, and it starts no thread once the pool has them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

from .read_plan import Task
from .worker_pool import HASHERS, READERS, run_bounded

__all__ = ["run_jobs"]

B = TypeVar("B")


def run_jobs(
    jobs: Sequence[list[Task]],
    *,
    threads: int,
    read: Callable[[Task], B],
    verify: Callable[[Task, B], None] | None,
    job_done: Callable[[list[Task]], None],
) -> None:
    """Run ``jobs`` on up to ``threads`` reader threads.

    Args:
        jobs: the tasks, grouped into jobs read in order by one thread each.
        read: reads a task into its destination; returns what ``verify`` needs.
        verify: raises when a task's bytes fail their hashes; ``None``: no verification.
        job_done: called in the calling thread once every task of a job is read and verified
            (never concurrently with another call).

    Raises:
        The first error of any read or verification; the jobs not started yet are not started
        and the running ones finish before it is raised.
    """
    runs = sum(len(j) > 1 for j in jobs)
    hashers, own_hashers = HASHERS.executor(threads) if verify is not None and runs else (None, False)

    def run(job: list[Task]) -> None:
        hashing: Future[None] | None = None
        try:
            for i, task in enumerate(job):
                got = read(task)
                if hashing is not None:
                    hashing.result()
                    hashing = None
                if verify is None:
                    continue
                if hashers is None or i == len(job) - 1:
                    verify(task, got)
                else:
                    hashing = hashers.submit(verify, task, got)
        finally:
            if hashing is not None and not hashing.cancel():
                wait([hashing])  # never leave a hash running into buffers the caller may free

    try:
        run_bounded(READERS, len(jobs), threads, lambda i: run(jobs[i]), lambda i, _: job_done(jobs[i]))
    finally:
        if own_hashers and hashers is not None:
            hashers.shutdown(wait=True, cancel_futures=True)
