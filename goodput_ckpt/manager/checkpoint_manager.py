"""``CheckpointManager``: steps, retention, the latest complete checkpoint, async saves, resume.

One checkpoint per step under a root (``ROOT/step_{step:08d}``, named by :mod:`.step_layout`), each a
goodput-format location written by :class:`~goodput_ckpt.CheckpointWriter` and holding the training
state bundle of :mod:`goodput_ckpt.state`. Call order (every rank of the job makes every call)::

    mgr = CheckpointManager(root, keep_last=3)              # collective: creates a gloo group
    last = mgr.restore(model=..., optimizer=..., ...)        # None when nothing complete exists
    mgr.save(step, model=..., optimizer=..., ...)            # returns once the state is staged
    ...
    mgr.wait(); mgr.close()

An async save stages the state into buffers kept from save to save (:mod:`.staging`: with
``async_staging``, the optimizers' tensors are copied behind the next forward and backward),
then hands the staged copy to the manager's one save thread (:mod:`.save_job`), which writes it,
applies retention on the coordinator and records the outcome. The next ``save`` (and
``restore``, ``wait``, ``close``) waits for it, so at most one save is in flight. Decisions all
ranks must share go through :mod:`.agreement`. Details and the failure policy:
``docs/manager.md``.

The job's storage is a chain of tiers (:mod:`.chain`): ``[persistent]``, or with ``local_dir``
``[local, replicas, persistent]``. A save is prepared by :mod:`.saving` and written to the
chain's first tier, which then spreads it (``Chain.after_write``); a restore hands the chain
one :class:`~.restoring.RestoreTarget`, which loads the per-rank rows, checks them on every
rank, then loads the tensors and applies them. This module is the public class: it checks the
arguments and calls those pieces in order; no branch here depends on the number of tiers. Its
read-only views (``steps``, ``latest_step``, ``step_uri``, ``extra``, ``timeline`` ...) live in
:mod:`.queries`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.collectives import Group
from ..errors import CheckpointError, as_checkpoint_error
from ..state import Topology, check_stateful, normalize
from ..storage import open_store
from .agreement import ExistingSteps, fail_on_every_rank, open_group
from .chain import Chain, agree_on_job, open_chain
from .config import ManagerConfig
from .incremental_saves import IncrementalSaves
from .job import JobState, job_of
from .queries import ManagerQueries
from .restoring import RestoreTarget
from .save_job import ErrorCallback, SaveJobs
from .saving import prepare_save
from .staging.async_staging import AsyncStaging
from .timeline import TimelineSink, timeline_target

__all__ = ["CheckpointManager", "ManagerConfig"]

logger = logging.getLogger("goodput_ckpt.manager")


class CheckpointManager(ManagerQueries):
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
        incremental: write only the tensors that changed since the last committed save of this
            process and reference the others in the earlier step that holds them
            (:mod:`goodput_ckpt.dcp.incremental`; retention keeps a step while a kept step
            references it). ``True``: every 10th save is full; an integer ``n``: every ``n``-th.
            With two tiers, replicas and persists send only what the receiver lacks
            (``docs/manager.md``). Not with ``overwrite`` (refused).
        free_space_on_full: when a save fails because the local disk (the root, or with two
            tiers the node's local directory) is full, delete the failed save's files, other
            incomplete steps and the oldest complete step beyond the newest one, and try the save
            once more (:mod:`.disk_full`). Default ``False``: the save fails, as does every later
            one until space is freed.
        timeline: where the per-save timeline goes (:mod:`goodput_ckpt.manager.timeline`): ``True``
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
        local_dir: str | os.PathLike | None = None,
        replicas: int = 0,
        persist_every: int = 1,
        local_keep_last: int | None = None,
        local_world_size: int | None = None,
        free_space_on_full: bool = False,
        incremental: bool | int = False,
        **storage_options: Any,
    ) -> None:
        self.config = ManagerConfig(
            keep_last=keep_last,
            async_save=async_save,
            async_staging=async_staging,
            fail_fast=fail_fast,
            save_rng=save_rng,
            allow_topology_change=allow_topology_change,
            overwrite=overwrite,
            thread_count=thread_count,
            chunk_size=chunk_size,
            verify=verify,
            timeout_s=timeout_s,
            local_dir=None if local_dir is None else os.fspath(local_dir),
            replicas=replicas,
            persist_every=persist_every,
            local_keep_last=local_keep_last,
            free_space_on_full=free_space_on_full,
            incremental=incremental,
        )
        if on_error is not None and not callable(on_error):
            raise TypeError("on_error must be callable(step, error)")
        self.root_uri = os.fspath(root_uri)
        self._storage_options = dict(storage_options)
        self._root = open_store(self.root_uri, self._storage_options)  # checks the options now
        self._timeline = TimelineSink(timeline_target(timeline, self._root.traits))
        self._staging = AsyncStaging(defer=self.config.async_staging, timeout_s=self.config.timeout_s)
        self._closed = False
        self._pg, self._own_pg = open_group(process_group)
        self._group = Group(self._pg)
        self._topology = Topology(rank=self._group.rank, world_size=self._group.world_size)
        self._job: JobState = agree_on_job(self.config, self._root, self._group)
        self._existing = ExistingSteps(self._group)
        self._incremental = IncrementalSaves.open(self.config.incremental)  # None: every save is full
        # The save thread reaches the chain through these (looked up at each call).
        self._saves = SaveJobs(
            pg=self._pg,
            staging=self._staging,
            timeline=self._timeline,
            timeout_s=self.config.timeout_s,
            on_commit=self._on_commit,
            on_error=on_error,
            after_write=lambda job, err: self._chain.after_write(job, err),
            make_room=(lambda job: self._chain.make_room(job)) if self.config.free_space_on_full else None,
        )
        #: The job's storage: [persistent], or [local, replicas, persistent] with ``local_dir``.
        self._chain: Chain = open_chain(
            self.config,
            root=self._root,
            root_uri=self.root_uri,
            storage_options=self._storage_options,
            group=self._group,
            topology=self._topology,
            local_world_size=local_world_size,
            timeline=self._timeline,
            on_failure=self._saves.report_failure,
            job=self._job,
        )

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
        uri, options = self._chain.save_target(step)  # with two tiers: the node-local tier
        started, t0 = time.time(), time.perf_counter()
        self._saves.finish_previous(report=False)
        self._chain.before_save(step)  # a retention beside the saves that may delete this step ends first
        if self.config.fail_fast and (failed := self._saves.take_unraised()) is not None:
            # Maybe a failure of this rank only (an upload's durability): fail this step everywhere.
            fail_on_every_rank(self._group, uri, failed, options)
            raise failed
        if not self.config.overwrite:
            where = self._root.uri + ("" if len(self._chain.names) == 1 else " or the local tier")
            lister = self.steps if self._chain.lists_steps() else None
            self._existing.refuse(step, uri, list_steps=lister, saved=self._saves.committed, where=where)
        t_waited = time.perf_counter()
        try:
            job, state, models = prepare_save(
                step,
                uri=uri,
                options=options,
                model=model,
                optimizer=optimizer,
                dataloader=dataloader,
                extra=extra,
                stateful=stateful,
                config=self.config,
                topology=self._topology,
                job=self._job,
                root=self._root,
                started=started,
                waited_s=t_waited - t0,
                incremental=self._incremental,
            )
        except Exception as e:
            fail_on_every_rank(self._group, uri, e, options)
            raise
        if not self.config.async_save:
            self._saves.save_now(job, state, blocked_from=t0, started=t_waited)
            return
        try:  # the only part of an async save that blocks
            skip = self._incremental.unstaged() if self._incremental is not None else ()
            staged, later = self._staging.stage(state, models, skip)  # unchanged tensors: not copied
        except BaseException as e:
            if isinstance(e, (Exception, CheckpointException)):
                err = as_checkpoint_error(e, f"staging step {step}")
                fail_on_every_rank(self._group, uri, err, options)
                raise err from e
            raise
        del state
        self._saves.submit(job, staged, later, blocked_from=t0, waited=t_waited)

    def wait_staged(self) -> None:
        """Finish the background staging copies of the save in flight, in this thread.

        Call it before changing parameters or optimizer states in place other than through an
        optimizer's ``step()`` (which waits by itself) while a save may still be staging.
        """
        self._staging.finish_pending()

    def _on_commit(self, committed: int) -> None:
        """The save thread, every rank, after ``committed`` committed: an incremental save's
        pieces become the next save's base, then the chain's retention runs (best effort)."""
        if self._incremental is not None:
            self._incremental.committed(committed)
        self._chain.apply_retention(committed)

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
        self._saves.finish_previous(report=False)  # a save in flight lands before anything is read
        if self._incremental is not None:
            self._incremental.reset()  # the live tensors are about to hold another step: next save full
        models = normalize(model, optimizer)
        check_stateful(stateful)
        target = RestoreTarget(
            models=models,
            dataloader=dataloader,
            stateful=dict(stateful),
            topology=self._topology,
            config=self.config,
            group=self._group,
            timeline=self._timeline,
        )
        try:
            # The chain picks the step and loads it in two parts (the per-rank rows, checked on
            # every rank, then the tensors: .restoring); then it is applied.
            restored = self._chain.restore(step, target)
            if restored is None:
                return None
            target.apply(restored)
            self._job.restored(job_of(restored.manifest, restored.where))  # checked before the loads
        except BaseException:
            models.discard_shaped_state()  # a fresh optimizer stays fresh (state/optim_state.py)
            raise
        return restored.step

    # -- lifecycle ------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the save in flight; raise the background failures not yet raised.

        Raises:
            CheckpointError: a background save failed since the last report (one failure as
                itself; several as one error naming every failed step, newest first, with the
                count).
        """
        self._check_open()
        self._saves.finish_previous(report=False)
        self._chain.wait(self.config.timeout_s)
        self._saves.finish_previous(report=True)

    def close(self) -> None:
        """Wait for the save in flight, release the buffers and the group. Idempotent.

        Raises:
            CheckpointError: as :meth:`wait` (resources are released all the same).
        """
        if self._closed:
            return
        try:
            self._saves.finish_previous(report=False)
            self._chain.wait(self.config.timeout_s)
            self._saves.finish_previous(report=True)
        finally:
            self._closed = True
            self._saves.shutdown()
            self._chain.close()
            self._staging.close()
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
            logger.error("closing %s after an error: %s", self._root.uri, e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this CheckpointManager ({self._root.uri}) is closed")
