"""Retention of the persistent root on a thread of its own, off the save thread's path.

Why: retention after a commit lists the root and deletes whole steps: at 16,384 ranks a step is
16,385 objects, 18 batched requests on S3 but still a listing of every kept step's files and
seconds of requests on a slow store. Run in the save thread, the next save waited for all of it
(issue 37: "off the save thread's critical path"). Here the save thread only hands the committed
step over (:meth:`BackgroundRetention.submit`), and one thread applies
:func:`~.retention.apply_retention`, one run at a time, while training and the next save go on.

What keeps it safe (each rule is why the deletions can never touch what is being written or read):

- One thread, one run at a time: two runs never delete at once. Runs waiting behind a running
  one are merged into one, for the newest commit: it deletes what each of them would have.
- A save never writes a step a pending run may delete. A run after ``committed`` deletes only
  complete steps outside the newest ``keep_last`` and incomplete steps older than ``committed``.
  A save of a step above every step submitted so far is neither while it is written (incomplete
  and newer), and after its commit a run for an older ``committed`` spares it (``protect``: the
  steps above ``committed`` whose saves this manager started, which their own run judges).
  A save of any other step (a rollback to an older number, an overwrite) first waits until
  nothing is pending (:meth:`BackgroundRetention.before_save`).
- A restore, the free-space path of a failed save, ``wait()`` and ``close()`` on the
  coordinator first wait until nothing is pending (:meth:`BackgroundRetention.drain`): they read
  or delete the steps a run deletes, or promise that the background work is done.
- A crash at any instant leaves what :func:`~.retention.delete_step` leaves (the commit record
  goes first, newest step first): every committed step stays readable; the leftovers are
  incomplete steps that the next restore or retention removes.

A synchronous save (``async_save=False``) waits for its run before it returns (the persistent
chain drains after the hand-over): such a save returns with everything done, as it always did.
A run's failure is logged and the next commit's run tries again (retention is best effort).
Only the coordinator retains (the caller makes this object there only). No torch here.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import CheckpointError
from ..storage.base import Store
from .retention import apply_retention

__all__ = ["BackgroundRetention"]

logger = logging.getLogger("goodput_ckpt.retention")


class BackgroundRetention:
    """The retention thread of one root.

    Args:
        root: the root whose steps are retained.
        keep_last: complete steps kept (``None``: all).
        timeout_s: the longest :meth:`drain` waits for the runs pending.
    """

    def __init__(self, root: Store, *, keep_last: int | None, timeout_s: float) -> None:
        self.root, self.keep_last, self.timeout_s = root, keep_last, timeout_s
        # Guards the fields below: the save thread submits, the training thread gates and
        # drains, the retention thread picks its run.
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made on the first submit
        self._waiting: int | None = None  # the newest commit no run has picked yet
        self._futures: list[Future] = []  # the runs submitted and not yet known to be done
        self._highest: int | None = None  # the highest step submitted so far
        # Steps whose saves this manager started (before_save), above the last run's commit:
        # a run spares those above its own commit (their own run judges them).
        self._started: set[int] = set()
        self.runs = 0  # runs applied (tests read it)

    def submit(self, committed: int) -> None:
        """Retain after ``committed`` (the save thread, once it is durable): returns at once."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="goodput-ckpt-retention")
            self._waiting = committed
            self._highest = committed if self._highest is None else max(self._highest, committed)
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._pool.submit(self._run))

    def _run(self) -> None:
        with self._lock:
            committed, self._waiting = self._waiting, None
            if committed is None:  # merged into a run that already took the newest commit
                return
        try:
            apply_retention(self.root, committed=committed, keep_last=self.keep_last, protect=_Newer(self, committed))
        except Exception:  # noqa: BLE001 - best effort, as apply_retention's own errors: the next run retries
            logger.exception("retention after step %d under %s failed", committed, self.root.uri)
        with self._lock:
            self.runs += 1
            self._started = {s for s in self._started if s > committed}

    def pending(self) -> bool:
        """Whether a run is running or waiting."""
        with self._lock:
            return any(not f.done() for f in self._futures)

    def before_save(self, step: int) -> None:
        """The training thread, before a save of ``step`` writes anything: wait for the runs
        pending unless ``step`` is above every step submitted (see the module doc); then
        record that its save started, so that runs already chosen spare it."""
        with self._lock:
            newer = self._highest is None or step > self._highest
        if not newer:
            self.drain()
        with self._lock:
            self._started.add(step)

    def drain(self) -> None:
        """Wait until no run is running or waiting.

        Raises:
            CheckpointError: a run is still going after ``timeout_s``.
        """
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            try:
                f.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise CheckpointError(
                    f"retention under {self.root.uri} is still running after {self.timeout_s:.0f}s", path=self.root.uri
                ) from None

    def close(self) -> None:
        """Wait for the runs pending (up to ``timeout_s``), then stop the thread. Idempotent."""
        try:
            self.drain()
        finally:
            with self._lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


class _Newer:
    """What a run after ``committed`` spares: the steps above it whose saves this manager
    started (read live: a save that commits while the run lists the root is spared too)."""

    def __init__(self, owner: BackgroundRetention, committed: int) -> None:
        self.owner, self.committed = owner, committed

    def __contains__(self, step: object) -> bool:
        with self.owner._lock:
            return isinstance(step, int) and step > self.committed and step in self.owner._started
