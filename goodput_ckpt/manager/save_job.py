"""The background save job: the manager's one save thread, the save in flight, its failures.

An async save hands its staged copy to :meth:`SaveJobs.submit`; the save thread finishes the
deferred staging copies, runs ``dcp.save`` (its planning collectives go over the manager's own
gloo group, so they never interleave with training collectives on the default group), releases
the buffers, waits until the checkpoint is durable, applies retention (the ``on_commit``
callback: on the persistent chain, a hand-over to the retention thread) and records the outcome
in the timeline. The next ``save`` (and ``restore``, ``wait``, ``close``) waits for it
(:meth:`SaveJobs.finish_previous`), so at most one save is in flight and a buffer is never
overwritten while it is written.

A failure never raises in the save thread: it becomes ``last_error``, goes to ``on_error``, and
is raised once at the next ``wait``/``close`` (or ``save`` with ``fail_fast``). A synchronous
save runs the same steps in the caller's thread (:meth:`SaveJobs.save_now`), with the cyclic
collector paused (``format/gc_pause.py``), and raises. Each save's timeline record
(:class:`~.timeline.SaveRecord`) is filled in here and nowhere else.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.plan_cache import SavePlanCache
from ..dcp.save_planner import ReplicaGroupingSavePlanner
from ..dcp.writer import CheckpointWriter
from ..errors import CheckpointError, as_checkpoint_error, find_interrupt
from ..format.gc_pause import gc_paused
from ..state.per_rank import WIDENED_ROWS
from .agreement import deliberate_no_dist
from .retention import note_committed
from .staging.async_staging import AsyncStaging
from .staging.confirmed_writer import ConfirmedWriter
from .staging.deferred_copy import DeferredCopies
from .timeline import SaveRecord, TimelineSink

__all__ = ["AfterWrite", "ErrorCallback", "SaveJob", "SaveJobs", "abandoned", "interpreter_exiting"]

logger = logging.getLogger("goodput_ckpt.manager")

#: ``on_error(step, error)``: called from the save thread when a background save fails.
ErrorCallback = Callable[[int, CheckpointError], None]

#: ``after_write(job, error) -> error``: the save thread's step after the write, on every rank
#: (two tiers: the manifest to every node, replicas, the persist hand-off); it returns the save's
#: error (``error`` or its own) and never raises.
AfterWrite = Callable[["SaveJob", "CheckpointError | None"], "CheckpointError | None"]


#: The failed saves a report names one by one (newest first); older ones are only counted, so
#: that a disk that stays full for a thousand saves costs neither memory nor a huge message.
REPORTED_FAILURES = 10


def all_failures(failed: list[tuple[int, CheckpointError]], count: int) -> CheckpointError:
    """One error for the ``count`` background failures not yet raised (``failed``: the newest
    of them with their steps, oldest first).

    Why: with a full disk every later save fails too, and raising only the first one hid that
    the newest checkpoints were all lost. One failure is raised as itself; several as one error
    of their common type (else ``CheckpointError``), newest first with the count, each by the
    first line of its message, chained to the newest."""
    if count == 1:
        return failed[-1][1]
    newest = failed[::-1]
    lines = "; ".join(f"step {s}: {_first_line(e)}" for s, e in newest)
    older = count - len(newest)
    kinds = {type(e) for _, e in newest}
    cls = kinds.pop() if len(kinds) == 1 else CheckpointError
    err = cls(
        f"{count} background saves failed, newest first: {lines}" + (f"; and {older} older" if older else ""),
        path=newest[0][1].path,
    )
    err.__cause__ = newest[0][1]
    return err


def _first_line(err: CheckpointError) -> str:
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= 300 else text[:297] + "..."


def interpreter_exiting() -> bool:
    """Whether the interpreter has stopped its main thread (the script ended, or a Ctrl-C left
    it) with this background work still running: Python then refuses new work on every thread
    pool, and nobody will call ``wait()`` or ``close()`` to hear about a failure."""
    return not threading.main_thread().is_alive()


def _on_interpreter_exit(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the interpreter begins to exit, before ``concurrent.futures`` stops its
    pools: ``threading``'s exit hooks run newest first, and ``concurrent.futures`` registers its
    own when it is imported, before any manager exists. (``atexit`` runs too late: by then every
    pool refuses work.) ``threading._register_atexit`` is private, but it is what
    ``concurrent.futures`` itself uses (Python 3.9+); without it, a save in flight at exit is
    reported as abandoned instead of finished."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    try:
        register(fn)
    except RuntimeError:  # the interpreter is already exiting
        pass


def abandoned(step: int) -> str:
    """The one line that reports a background save or persist the interpreter's exit cut off."""
    return (
        f"the save of step {step} was abandoned: the interpreter exited while it was in flight "
        "(call wait() or close() before exiting to finish it); that step stays incomplete"
    )


@dataclass(eq=False)
class SaveJob:
    """One save: where it goes, its writer and its timeline record."""

    step: int
    uri: str
    writer: CheckpointWriter
    record: SaveRecord
    done: Future | None = None  # an async save's task: done after commit, release, retention, recording


class SaveJobs:
    """The save thread of one manager and the save it runs.

    Args:
        pg: the manager's group (``None``: one process, ``no_dist``).
        staging: the manager's async staging (buffers to release, copies to confirm).
        timeline: where the records go.
        timeout_s: the longest wait for a previous save or for durability.
        on_commit: ``on_commit(step)`` after a save committed and is durable (retention).
        on_error: the user's ``on_error`` (see :data:`ErrorCallback`), or ``None``.
        after_write: with two tiers, spreads each local save (every rank calls it after every
            write, failed or not, since it is collective); see :data:`AfterWrite`.
        make_room: ``make_room(job)``, every rank, after ``dcp.save`` failed: whether the disk
            was full and room was made, so that the save is tried once more (collective; see
            :mod:`.disk_full`). ``None``: never retried.

    Attributes:
        last_error: the most recent failure of a background save, or ``None``.
    """

    def __init__(
        self,
        *,
        pg: dist.ProcessGroup | None,
        staging: AsyncStaging,
        timeline: TimelineSink,
        timeout_s: float,
        on_commit: Callable[[int], None],
        on_error: ErrorCallback | None,
        after_write: AfterWrite | None = None,
        make_room: Callable[[SaveJob], bool] | None = None,
    ) -> None:
        self.pg = pg
        self._staging = staging
        self._timeline = timeline
        self._timeout_s = timeout_s
        self._on_commit = on_commit
        self._on_error = on_error
        self._after_write = after_write
        self._make_room = make_room
        self.last_error: CheckpointError | None = None
        # The failures not yet raised: the newest few with their steps, and how many in all.
        self._unraised: collections.deque[tuple[int, CheckpointError]] = collections.deque(maxlen=REPORTED_FAILURES)
        self._unraised_count = 0
        self._lock = threading.Lock()  # guards last_error / _unraised (save thread vs caller)
        self._inflight: SaveJob | None = None
        # One long-lived thread writes async saves (created on the first): dcp.async_save would
        # start a new thread per save, and on busy cores waiting for it to start costs ms.
        self._worker: ThreadPoolExecutor | None = None
        self._abandoned = False  # the interpreter exited before the save in flight finished
        self.committed: set[int] = set()  # steps saved by this manager (the same on every rank)
        # The last save's plans: later saves of the same layout send digests (dcp/plan_cache.py).
        self.plan_cache = SavePlanCache()

    @property
    def in_flight_step(self) -> int | None:
        """The step an async save is still writing (or applying retention after), or ``None``."""
        job = self._inflight
        return None if job is None or job.done is None or job.done.done() else job.step

    # -- a synchronous save ---------------------------------------------------------------------
    def save_now(self, job: SaveJob, state: dict[str, Any], *, blocked_from: float, started: float) -> None:
        """Write ``state`` in this thread, wait until it is durable, apply retention, record it.

        ``blocked_from``: when ``save`` was called, ``started``: when the write starts
        (``time.perf_counter()`` values).

        Raises:
            CheckpointError: the save failed (recorded as failed; retention not applied).
        """
        err: CheckpointError | None = None
        try:
            with gc_paused():  # the caller waits: no full collection set off by the save's own objects
                self._dcp_save(job, state)
            job.record.written(time.perf_counter() - started)
            self.wait_durable(job)
        except (Exception, CheckpointException) as e:
            err = as_checkpoint_error(e, f"saving step {job.step} to {job.uri}")
        if self._after_write is not None:
            err = self._after_write(job, err)
        self._emit(job.record, started, err, stall_from=blocked_from)
        if err is not None:
            raise err
        self._committed(job)

    # -- an async save ------------------------------------------------------------------------------
    def submit(
        self, job: SaveJob, staged: dict[str, Any], later: DeferredCopies, *, blocked_from: float, waited: float
    ) -> None:
        """Hand a staged save to the save thread; ``save`` returns after this.

        ``blocked_from``: when ``save`` was called, ``waited``: when it was done waiting for
        the previous save (``time.perf_counter()`` values); staging ended now.
        """
        handed_off = time.perf_counter()
        job.record.staged(stage_s=handed_off - waited, stall_s=handed_off - blocked_from)
        assert isinstance(job.writer, ConfirmedWriter)
        job.writer.copies = later
        job.writer.mark_background_save()  # it runs beside training: see LocalConfig.direct_writes
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="goodput-ckpt-save")
            ref = weakref.ref(self)  # the hook must not keep a dropped manager's buffers alive
            _on_interpreter_exit(lambda: (jobs := ref()) is not None and jobs.finish_at_exit())
        self._staging.arm(later)
        try:
            job.done = self._worker.submit(self.write, job, staged, later, handed_off)
        except BaseException:
            later.finish()
            self._staging.release()
            raise
        self._inflight = job

    def write(self, job: SaveJob, staged: dict[str, Any], later: DeferredCopies, handed_off: float) -> None:
        """Save thread: finish the deferred staging copies, write the staged state and commit it
        if the copies are good on every rank (the writer is a ``ConfirmedWriter``), free
        the buffers, wait until it is durable, apply retention, record the outcome. Never
        raises: failures are reported through ``wait``/``last_error``."""
        err: CheckpointError | None = None
        try:
            try:
                later.finish()
                job.record.guarded(later.blocked_seconds())
                self._dcp_save(job, staged)
            finally:
                del staged
                self._staging.release()
            job.record.written(time.perf_counter() - handed_off)
            self.wait_durable(job)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            err = as_checkpoint_error(e, f"saving step {job.step} to {job.uri}")
        if err is not None and (self._abandoned or interpreter_exiting()):
            err = CheckpointError(abandoned(job.step), path=job.uri)  # not the pool's "cannot schedule"
        if self._after_write is not None:
            err = self._after_write(job, err)
        self._emit(job.record, handed_off, err)
        if err is None:
            logger.info("committed step %d at %s", job.step, job.uri)
            self._committed(job)
            return
        self.report_failure(job.step, err)

    def report_failure(self, step: int, err: CheckpointError) -> None:
        """A background failure (a save here, or a persist of two tiers): ``last_error``,
        ``on_error``, and raised once at the next ``wait``/``close``. Any thread."""
        with self._lock:
            self.last_error = err
            self._unraised.append((step, err))
            self._unraised_count += 1
        if self._abandoned or interpreter_exiting():  # nobody will call wait() or close()
            if not self._abandoned:  # one line, no traceback
                logger.warning("%s", abandoned(step))
            return
        logger.error("background save of step %d failed: %s", step, err)
        if self._on_error is not None:
            try:
                self._on_error(step, err)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the save error
                logger.exception("on_error callback raised")

    # -- shared -----------------------------------------------------------------------------------
    def _committed(self, job: SaveJob) -> None:
        """After ``job`` committed and is durable: remember it, hand its record to retention
        (:func:`~.retention.note_committed`, no read back), retain."""
        self.committed.add(job.step)
        record = getattr(job.writer, "committed_record", None)
        if record is not None:
            note_committed(job.writer.store.uri, record)
        self._on_commit(job.step)

    def _dcp_save(self, job: SaveJob, state: dict[str, Any]) -> None:
        """``dcp.save`` of ``state`` through ``job.writer``, every rank together. When it fails and
        ``make_room`` (``free_space_on_full``) says the disk was full and room was made, once
        more: every rank gets the same failure from DCP and the same answer from ``make_room``
        (a collective), so every rank retries or none."""
        for attempt in range(2):
            try:
                dcp.save(
                    state,
                    storage_writer=job.writer,
                    planner=ReplicaGroupingSavePlanner(widen_rows=WIDENED_ROWS, plan_cache=self.plan_cache),
                    process_group=self.pg,
                    no_dist=deliberate_no_dist(self.pg is None),
                )
                if job.writer.reuse is not None:  # an incremental save: the writer's own counters
                    job.record.written_bytes = job.writer.bytes_written
                    job.record.referenced_bytes = job.writer.bytes_referenced
                return
            except (Exception, CheckpointException) as e:
                if attempt or self._make_room is None or find_interrupt(e) is not None or not self._make_room(job):
                    raise

    def wait_durable(self, job: SaveJob) -> None:
        """Wait until the committed checkpoint is durable at its final location (later than the
        commit only with local staging onto a volume), so retention and ``steps()`` see it."""
        fut = job.writer.durable_future()
        if fut.done():
            fut.result()
            return
        try:
            fut.result(timeout=self._timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"the upload of step {job.step} to {job.uri} is still running after {self._timeout_s:.0f}s",
                path=job.uri,
            ) from None

    def _emit(
        self, record: SaveRecord, since: float, err: CheckpointError | None, *, stall_from: float | None = None
    ) -> None:
        record.finish(since, None if err is None else str(err), stall_from=stall_from)
        self._timeline.emit(record)

    def finish_previous(self, *, report: bool) -> None:
        """Wait for the save in flight; raise its error when ``report`` (and forget it).

        Called from the training thread, so it first confirms that save's deferred copies: no
        in-place change of the state is running now (see ``DeferredCopies.confirm``)."""
        self._staging.finish_pending()
        job = self._inflight
        if job is not None:
            assert job.done is not None
            try:
                job.done.result(timeout=self._timeout_s)
            except FutureTimeout:
                raise CheckpointError(
                    f"the save of step {job.step} to {job.uri} is still running after {self._timeout_s:.0f}s",
                    path=job.uri,
                ) from None
            self._inflight = None
        if report and (err := self.take_unraised()) is not None:
            raise err

    def finish_at_exit(self) -> None:
        """At interpreter exit, while thread pools still take work: wait for the save in flight,
        up to ``timeout_s``. Past that, or on a second Ctrl-C, it is abandoned, with one line.
        Its own failure, if any, was already reported by the save thread."""
        job = self._inflight
        if job is None or job.done is None or job.done.done():
            return
        logger.info("finishing the save of step %d before the interpreter exits", job.step)
        try:
            job.done.result(timeout=self._timeout_s)
        except (FutureTimeout, KeyboardInterrupt):
            self._abandoned = True
            if isinstance(job.writer, ConfirmedWriter):  # the exit joins the save thread: no commit
                job.writer.failure = CheckpointError(abandoned(job.step), path=job.uri)
            logger.warning("%s", abandoned(job.step))
        except BaseException:  # noqa: BLE001 - reported by the save thread; exiting anyway
            pass

    def take_unraised(self) -> CheckpointError | None:
        """The background failures not yet raised, now counted as raised: the one failure
        itself, or one error that lists every failed step (:func:`all_failures`)."""
        with self._lock:
            failed, count = list(self._unraised), self._unraised_count
            self._unraised.clear()
            self._unraised_count = 0
        return all_failures(failed, count) if failed else None

    def shutdown(self) -> None:
        """Stop the save thread; a save still in flight here timed out in :meth:`finish_previous`,
        so do not wait for it."""
        if self._worker is not None:
            self._worker.shutdown(wait=self._inflight is None, cancel_futures=True)
