"""``CheckpointManager``: steps, retention, the latest complete checkpoint, async saves, resume.

One checkpoint per step under a root (``ROOT/step_{step:08d}``, named by :mod:`.layout`), each a
format-v1 location written by :class:`~goodput_ckpt.CheckpointWriter` and holding the training
state bundle of :mod:`.state`. Call order (every rank of the job makes every call)::

    mgr = CheckpointManager(root, keep_last=3)              # collective: creates a gloo group
    last = mgr.restore(model=..., optimizer=..., ...)        # None when nothing complete exists
    mgr.save(step, model=..., optimizer=..., ...)            # returns once the state is staged
    ...
    mgr.wait(); mgr.close()

An async save stages the state into buffers that a
:class:`~goodput_ckpt.dcp.staging.ReusableStager` keeps from save to save, then hands the staged
copy to the manager's one save thread. With ``async_staging`` (the default) only what a forward
pass may change is copied in the caller's thread; the parameters and optimizer states are copied
by the save thread behind the next forward and backward, and a pre-hook on each optimizer's
``step()`` finishes those copies before the step changes them (:mod:`.step_guard`). The save
thread then runs ``dcp.save`` (its planning collectives go
over the manager's own gloo group, so they never interleave with training collectives on the
default group), releases the buffers, applies retention on the coordinator and records the
outcome. The next ``save`` (and ``restore``, ``wait``, ``close``) waits for it, so at most one
save is in flight, a buffer is never overwritten while it is written, and retention never races
a save. Details and the failure policy: ``docs/manager.md``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .dcp.manifest_load import load_manifest
from .dcp.reader import CheckpointReader
from .dcp.staging import ReusableStager
from .dcp.writer import CheckpointWriter
from .errors import CheckpointError, as_checkpoint_error
from .layout import child_uri, step_dir_name
from .manager_config import ManagerConfig
from .dcp.confirmed_writer import ConfirmedWriter
from .dcp.deferred_copy import DeferredCopies
from .retention import clean_before_restore, delete_step, retention_victims, scan_steps
from .state import EXTRA_KEY, Topology, apply_restore, build_save_state, check_stateful, normalize, plan_restore
from .storage import open_store
from .step_guard import StepGuard, guarded_tensor_keys, tensor_key
from .timeline import TIMELINE_NAME, TimelineSink, finish_save_record, new_record, tensor_nbytes

__all__ = ["CheckpointManager", "ManagerConfig"]

logger = logging.getLogger("goodput_ckpt.manager")

#: ``on_error(step, error)``: called from the save thread when a background save fails.
ErrorCallback = Callable[[int, CheckpointError], None]


@dataclass(eq=False)
class _Save:
    """One async save in flight."""

    step: int
    uri: str
    record: dict[str, Any]  # its timeline record, completed by the save thread
    done: Future | None = None  # the save task: done after commit, release, retention, recording


class CheckpointManager:
    """Save and resume the whole training state, one checkpoint per step under ``root_uri``.

    Args:
        root_uri: the root: a local path, ``file://`` URL, or any URI the stores support.
        keep_last: complete checkpoints to keep (``None``: all). The newest complete one and the
            one just written are never deleted, nor a checkpoint still being written.
        async_save: ``save`` returns once the state is copied into reused CPU buffers, and the
            write runs in the background. With ``False`` it returns once committed.
        async_staging: with ``async_save``, copy the parameters and optimizer states of the
            optimizers passed to ``save`` in the background too: ``save`` returns at once and
            those optimizers' next ``step()`` waits for what is left of the copy (usually
            nothing). Other in-place changes to them before that step fail the save (call
            ``wait_staged()`` first). ``False``: ``save`` copies everything before returning.
        fail_fast: raise a failed background save at the next ``save`` (default: log it, expose
            it as ``last_error``, call ``on_error``, and raise it at ``wait``/``close``).
        on_error: ``on_error(step, error)``, called from a background thread when a save fails.
        save_rng: save every rank's RNG state (Python, NumPy, torch CPU, initialized CUDA).
        allow_topology_change: restore under another world size (or dataloader worker count /
            batch size) by skipping the per-rank RNG and dataloader state instead of refusing.
        overwrite: allow a save to replace a committed checkpoint of the same step.
        process_group: the group to checkpoint over. Default: a new gloo group over all ranks
            when torch.distributed is initialized (creating it is collective), else none.
        thread_count, chunk_size: passed to ``CheckpointWriter`` (``thread_count`` also to the
            reader); ``verify``: check hashes on restore.
        timeout_s: the longest wait for a previous save (``save``, ``restore``, ``close``).
        timeline: where the per-save timeline goes (:mod:`goodput_ckpt.timeline`): ``True``
            (default) appends JSON lines to ``ROOT/goodput-timeline.jsonl`` when the root is a
            local directory (elsewhere it stays in memory); a local file path; a callable that
            receives each record; ``False``: in memory only.
        **storage_options: backend options of the store (for local disk, ``fsync=``); an
            unknown one is a ``TypeError``.

    Attributes:
        last_error: the most recent failure of a background save, or ``None``.
        timeline: this rank's newest timeline records (dicts, oldest first).
    """

    def __init__(
        self,
        root_uri: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        async_save: bool = True,
        async_staging: bool = True,
        fail_fast: bool = False,
        on_error: ErrorCallback | None = None,
        save_rng: bool = True,
        allow_topology_change: bool = False,
        overwrite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        thread_count: int | None = None,
        chunk_size: int | None = None,
        verify: bool = True,
        timeout_s: float = 1800.0,
        timeline: str | os.PathLike | Callable[[dict[str, Any]], None] | bool = True,
        **storage_options: Any,
    ) -> None:
        self.config = ManagerConfig(
            keep_last=keep_last, async_save=async_save, async_staging=async_staging, fail_fast=fail_fast, save_rng=save_rng,
            allow_topology_change=allow_topology_change, overwrite=overwrite, thread_count=thread_count,
            chunk_size=chunk_size, verify=verify, timeout_s=timeout_s,
        )  # fmt: skip
        if on_error is not None and not callable(on_error):
            raise TypeError("on_error must be callable(step, error)")
        self.root_uri = os.fspath(root_uri)
        self._storage_options = dict(storage_options)
        self._root = open_store(self.root_uri, self._storage_options)  # checks the options now
        self._on_error = on_error
        self._timeline = TimelineSink(self._timeline_target(timeline))
        self.last_error: CheckpointError | None = None
        self._unraised: CheckpointError | None = None
        self._lock = threading.Lock()  # guards last_error / _unraised (save thread vs caller)
        self._inflight: _Save | None = None
        self._stager = ReusableStager(timeout_s=self.config.timeout_s)
        self._guard = StepGuard()
        # One long-lived thread writes async saves (created on the first): dcp.async_save would
        # start a new thread per save, and on busy cores waiting for it to start costs ms.
        self._worker: ThreadPoolExecutor | None = None
        self._closed = False
        self._own_pg = False
        if process_group is not None:
            self._pg: dist.ProcessGroup | None = process_group
        elif dist.is_available() and dist.is_initialized():
            # Async saves run collectives from a background thread; on their own group they
            # never interleave with the training loop's collectives on the default group.
            self._pg = dist.new_group(backend="gloo")
            self._own_pg = True
        else:
            self._pg = None
            # Without a process group the manager passes no_dist=True on purpose; torch still
            # warns on every save and load that it "assumes a single process". Silence just that.
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        if self._pg is not None:
            self._topology = Topology(rank=dist.get_rank(self._pg), world_size=dist.get_world_size(self._pg))
        else:
            self._topology = Topology(rank=0, world_size=1)

    def _timeline_target(self, timeline: Any) -> Any:
        if timeline is True:
            # Only a local disk can append (a volume writes each file once).
            traits = self._root.traits
            return os.path.join(traits.local_path, TIMELINE_NAME) if traits.can_append and traits.local_path else None
        if timeline is False or timeline is None:
            return None
        if callable(timeline) or isinstance(timeline, (str, os.PathLike)):
            return timeline
        raise TypeError(f"timeline must be a bool, a file path or a callable, got {type(timeline).__name__}")

    # -- queries --------------------------------------------------------------------------------
    @property
    def timeline(self) -> list[dict[str, Any]]:
        """This rank's newest timeline records (see :mod:`goodput_ckpt.timeline`), oldest first."""
        return list(self._timeline.records)

    @property
    def timeline_path(self) -> str | None:
        """The JSON-lines file the timeline is appended to, or ``None``."""
        return self._timeline.path

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank deletes old checkpoints and decides which step to restore."""
        return self._topology.rank == 0

    @property
    def in_flight_step(self) -> int | None:
        """The step an async save is still writing (or applying retention after), or ``None``."""
        job = self._inflight
        return None if job is None or job.done is None or job.done.done() else job.step

    def steps(self) -> list[int]:
        """The steps that hold a complete (committed) checkpoint, ascending."""
        return scan_steps(self._root).complete

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_uri(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (for ``CheckpointReader`` or the tools)."""
        return child_uri(self.root_uri, step_dir_name(step))

    def extra(self, step: int) -> dict[str, Any]:
        """The ``extra`` metadata saved with ``step``.

        Raises:
            CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
        """
        manifest = load_manifest(open_store(self.step_uri(step), self._storage_options))
        extra = manifest.metadata.get(EXTRA_KEY, {})
        return dict(extra) if isinstance(extra, dict) else {}

    # -- save -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        model: Any,
        optimizer: Any = None,
        dataloader: Any = None,
        extra: Mapping[str, Any] | None = None,
        **stateful: Any,
    ) -> None:
        """Checkpoint the training state of ``step`` (every rank calls it).

        Waits for the previous save first. With ``async_save`` it returns once the state is
        staged; what training does afterwards never reaches this checkpoint.

        Raises:
            TypeError / ValueError: bad arguments (``extra`` not JSON, a reserved name ...).
            CheckpointError: a synchronous save failed; with ``fail_fast``, the previous
                background save failed.
        """
        self._check_open()
        uri = child_uri(self.root_uri, step_dir_name(step))
        started, t0 = time.time(), time.perf_counter()
        self._finish_previous(report=False)
        if self.config.fail_fast and (failed := self._take_unraised()) is not None:
            # Maybe a failure of this rank only (an upload's durability): fail this step everywhere.
            self._fail_on_every_rank(uri, failed)
            raise failed
        t_waited = time.perf_counter()
        try:
            models = normalize(model, optimizer)
            check_stateful(stateful)
            state, metadata = build_save_state(
                step, models=models, dataloader=dataloader, stateful=stateful, topology=self._topology,
                save_rng=self.config.save_rng, extra=extra,
            )  # fmt: skip
            writer_options = dict(
                thread_count=self.config.thread_count, chunk_size=self.config.chunk_size,
                overwrite=self.config.overwrite, metadata=metadata, **self._storage_options,
            )  # fmt: skip
            # An async save commits only if every rank's deferred copies are good
            # (dcp/confirmed_writer.py).
            writer_cls = ConfirmedWriter if self.config.async_save else CheckpointWriter
            writer = writer_cls(uri, **writer_options)
        except Exception as e:
            self._fail_on_every_rank(uri, e)
            raise
        record = self._record("save", step, started, **{"async": self.config.async_save})
        record["wait_s"] = t_waited - t0
        record["guard_s"] = 0.0  # async staging: what the next optimizer step waited (save thread)
        record["bytes"] = tensor_nbytes(state)
        if not self.config.async_save:
            try:
                dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
                record["write_s"] = time.perf_counter() - t_waited
                self._wait_durable(writer, step, uri)
            except (Exception, CheckpointException) as e:
                err = as_checkpoint_error(e, f"saving step {step} to {uri}")
                self._finish_record(record, t_waited, err, stall_from=t0)
                raise err
            self._finish_record(record, t_waited, None, stall_from=t0)
            self._apply_retention(step)
            return
        try:  # the only part of an async save that blocks
            staged, later = self._stager.stage_deferred(state, self._deferrable(models))
        except BaseException as e:
            if isinstance(e, (Exception, CheckpointException)):
                err = as_checkpoint_error(e, f"staging step {step}")
                self._fail_on_every_rank(uri, err)
                raise err from e
            raise
        del state
        t_staged = time.perf_counter()
        record["stage_s"] = t_staged - t_waited
        record["stall_s"] = t_staged - t0
        assert isinstance(writer, ConfirmedWriter)
        writer.copies = later
        job = _Save(step, uri, record)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="goodput-ckpt-save")
        self._guard.arm(later)
        try:
            job.done = self._worker.submit(self._write, job, staged, later, writer, t_staged)
        except BaseException:
            later.finish()
            self._stager.release()
            raise
        self._inflight = job

    def _fail_on_every_rank(self, uri: str, err: BaseException) -> None:
        """This rank cannot save to ``uri`` (``err``) while the other ranks go on into
        ``dcp.save``: join them with a save that fails in DCP's first collective phase, so the
        save fails on every rank (with this rank's error) instead of leaving them waiting for
        this rank, and every rank's next save pairs with the same step. Alone: nothing to do."""
        if self._pg is None:
            return
        try:
            writer = ConfirmedWriter(uri, **self._storage_options)
            writer.failure = err
            dcp.save({}, storage_writer=writer, process_group=self._pg)
        except (Exception, CheckpointException):
            pass  # the failure it was made for; ``err`` is raised by the caller

    def _deferrable(self, models: Any) -> Callable[[Any], bool] | None:
        """Which sources ``save`` may leave to the save thread: the tensors of the optimizers
        passed to it, which only their (hooked) ``step()`` changes. ``None``: copy all now."""
        if not (self.config.async_save and self.config.async_staging):
            return None
        optimizers = [o for _, opts in models.pairs.values() for o in opts if self._guard.can_guard(o)]
        keys = guarded_tensor_keys(optimizers)
        if not keys:
            return None
        self._guard.watch(optimizers)
        return lambda t: tensor_key(t) in keys

    def wait_staged(self) -> None:
        """Finish the background staging copies of the save in flight, in this thread.

        Call it before changing parameters or optimizer states in place other than through an
        optimizer's ``step()`` (which waits by itself) while a save may still be staging.
        """
        self._guard.finish_pending()

    def _write(
        self, job: _Save, staged: dict[str, Any], later: DeferredCopies, writer: ConfirmedWriter, handed_off: float
    ) -> None:
        """Save thread: finish the deferred staging copies, write the staged state and commit it
        if the copies are good on every rank (``writer`` is a ``ConfirmedWriter``), free
        the buffers, wait until it is durable, apply retention, record the outcome. Never
        raises: failures are reported through ``wait``/``last_error``."""
        err: CheckpointError | None = None
        try:
            try:
                later.finish()
                job.record["guard_s"] = later.blocked_seconds()
                job.record["stall_s"] += job.record["guard_s"]
                dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
            finally:
                del staged
                self._stager.release()
            job.record["write_s"] = time.perf_counter() - handed_off
            self._wait_durable(writer, job.step, job.uri)
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            err = as_checkpoint_error(e, f"saving step {job.step} to {job.uri}")
        self._finish_record(job.record, handed_off, err)
        if err is None:
            logger.info("committed step %d at %s", job.step, job.uri)
            self._apply_retention(job.step)
            return
        with self._lock:
            self.last_error = err
            if self._unraised is None:
                self._unraised = err
        logger.error("background save of step %d failed: %s", job.step, err)
        if self._on_error is not None:
            try:
                self._on_error(job.step, err)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the save error
                logger.exception("on_error callback raised")

    def _wait_durable(self, writer: CheckpointWriter, step: int, uri: str) -> None:
        """Wait until the committed checkpoint is durable at its final location (later than the
        commit only with local staging onto a volume), so retention and ``steps()`` see it."""
        fut = writer.durable_future()
        if fut.done():
            fut.result()
            return
        try:
            fut.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"the upload of step {step} to {uri} is still running after {self.config.timeout_s:.0f}s", path=uri
            ) from None

    def _record(self, event: str, step: int, started: float, **fields: Any) -> dict[str, Any]:
        return new_record(event, step, self._topology.rank, self._topology.world_size, started, **fields)

    def _finish_record(
        self, record: dict[str, Any], since: float, err: CheckpointError | None, *, stall_from: float | None = None
    ) -> None:
        self._timeline.emit(finish_save_record(record, since, None if err is None else str(err), stall_from=stall_from))

    def _finish_previous(self, *, report: bool) -> None:
        """Wait for the save in flight; raise its error when ``report`` (and forget it).

        Called from the training thread, so it first confirms that save's deferred copies: no
        in-place change of the state is running now (see ``DeferredCopies.confirm``)."""
        self._guard.finish_pending()
        job = self._inflight
        if job is not None:
            assert job.done is not None
            try:
                job.done.result(timeout=self.config.timeout_s)
            except FutureTimeout:
                raise CheckpointError(
                    f"the save of step {job.step} to {job.uri} is still running after "
                    f"{self.config.timeout_s:.0f}s",
                    path=job.uri,
                ) from None
            self._inflight = None
        if report and (err := self._take_unraised()) is not None:
            raise err

    def _take_unraised(self) -> CheckpointError | None:
        """The first background failure not yet raised, now counted as raised."""
        with self._lock:
            err, self._unraised = self._unraised, None
        return err

    # -- retention ----------------------------------------------------------------------------------
    def _apply_retention(self, committed: int) -> None:
        """Coordinator, after ``committed`` was committed and with no other save in flight
        (policy: :mod:`goodput_ckpt.retention`). Best effort: failures are logged."""
        if not self.is_coordinator:
            return
        try:
            scan = scan_steps(self._root)
            for s in retention_victims(scan, committed=committed, keep_last=self.config.keep_last):
                delete_step(self._root, s, scan.files[s])
        except CheckpointError as e:
            logger.warning("retention under %s failed (will retry after the next save): %s", self._root.uri, e)

    # -- restore ------------------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        model: Any,
        optimizer: Any = None,
        dataloader: Any = None,
        **stateful: Any,
    ) -> int | None:
        """Load the checkpoint of ``step`` (default: the newest complete one) into the objects.

        Every rank calls it. Model and optimizer reshard to the current topology; per-rank RNG
        and dataloader state follow the topology policy (``allow_topology_change``). Incomplete
        checkpoints are ignored and deleted (by the coordinator).

        Returns:
            The restored step, or ``None`` when ``step`` is ``None`` and no checkpoint is complete.

        Raises:
            TopologyChangeError: per-rank state saved under another topology (see above).
            CheckpointNotFoundError / IncompleteCheckpointError: an explicit ``step`` that is
                missing or was never committed.
            CorruptCheckpointError, CheckpointError: the checkpoint cannot be loaded.
        """
        self._check_open()
        self._finish_previous(report=False)  # a save in flight lands before anything is read
        models = normalize(model, optimizer)
        check_stateful(stateful)
        if step is None:
            step = self._agree_on_latest()
            if step is None:
                return None
        started, t0 = time.time(), time.perf_counter()
        uri = child_uri(self.root_uri, step_dir_name(step))
        reader = CheckpointReader(
            uri, verify=self.config.verify, thread_count=self.config.thread_count, process_group=self._pg,
            **self._storage_options,
        )  # fmt: skip
        plan, local_err = None, None
        try:
            plan = plan_restore(
                reader.manifest, where=uri, models=models, dataloader=dataloader, stateful=stateful,
                topology=self._topology, allow_topology_change=self.config.allow_topology_change,
            )  # fmt: skip
        except CheckpointError as e:
            local_err = e
        self._agree(local_err)
        assert plan is not None
        try:
            dcp.load(plan.dest, storage_reader=reader, process_group=self._pg, no_dist=self._pg is None)
        except (Exception, CheckpointException) as e:
            raise as_checkpoint_error(e, f"loading step {step} from {uri}")
        apply_restore(plan)
        self._timeline.emit(
            self._record("restore", step, started, seconds=time.perf_counter() - t0, bytes=tensor_nbytes(plan.dest), ok=True, error=None)
        )
        for note in plan.notes:
            logger.warning("restore of step %d: %s", step, note)
            warnings.warn(f"restore of step {step}: {note}", stacklevel=2)
        logger.info("restored step %d from %s", step, uri)
        return step

    def _agree_on_latest(self) -> int | None:
        """The coordinator picks the newest complete step (and applies retention: incomplete steps
        and complete ones beyond ``keep_last`` go); every rank gets its choice, so all ranks load
        the same step."""
        choice: list[Any] = [None, None]
        if self.is_coordinator:
            try:
                choice[0] = clean_before_restore(self._root, keep_last=self.config.keep_last)
            except CheckpointError as e:
                choice[1] = str(e)
        if self._pg is not None:
            dist.broadcast_object_list(choice, group=self._pg, group_src=0)
        if choice[1] is not None:
            raise CheckpointError(f"listing checkpoints under {self._root.uri} failed on the coordinator: {choice[1]}")
        return choice[0]

    def _agree(self, local_err: CheckpointError | None) -> None:
        """Raise on every rank when any rank failed to plan, instead of letting the others hang in
        the load's collectives."""
        if self._pg is None:
            if local_err is not None:
                raise local_err
            return
        errors: list[Any] = [None] * self._topology.world_size
        dist.all_gather_object(errors, None if local_err is None else str(local_err), group=self._pg)
        if local_err is not None:
            raise local_err
        for rank, msg in enumerate(errors):
            if msg is not None:
                raise CheckpointError(f"restore failed on rank {rank}: {msg}")

    # -- lifecycle ------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the save in flight; raise the first background failure not yet raised.

        Raises:
            CheckpointError: a background save failed since the last report.
        """
        self._check_open()
        self._finish_previous(report=True)

    def close(self) -> None:
        """Wait for the save in flight, release the buffers and the group. Idempotent.

        Raises:
            CheckpointError: as :meth:`wait` (resources are released all the same).
        """
        if self._closed:
            return
        try:
            self._finish_previous(report=True)
        finally:
            self._closed = True
            if self._worker is not None:
                # A save still in flight here timed out in _finish_previous: do not wait forever.
                self._worker.shutdown(wait=self._inflight is None, cancel_futures=True)
            self._guard.close()
            self._stager.close()
            if self._own_pg and self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
            self._pg = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: do not mask it with a save failure
            self.close()
        except CheckpointError as e:
            logger.error("closing %s after an error: %s", self.root_uri, e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this CheckpointManager ({self.root_uri}) is closed")

