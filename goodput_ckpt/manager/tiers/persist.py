"""The persistent tier: every ``persist_every``-th save, copied from the node-local copy.

The copy runs on its own thread with its own gloo group, so the local saves that follow never
wait for it (their collectives go over the manager's group, in the save thread), and training
never does. Each rank uploads its own data files from its node's copy, every chunk checked
against the manifest on the way (a damaged local copy is never persisted), then the ranks
agree, and the coordinator commits the same manifest at the persistent location and applies
retention there. A failure is reported like a failed background save (``last_error``,
``on_error``, raised at ``wait``/``close``) and the local tier keeps the step.

One persist runs at a time: when the next one is due while the previous one still runs, the
save thread waits for it (the local saves in between are not delayed by it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ...dcp.collectives import Group
from ...engine.hashed_write import clear_or_refuse_existing, data_file_rank, durable_future
from ...errors import CheckpointError, as_checkpoint_error
from ...format.commit_record import KeyIndex
from ...format.manifest import MANIFEST_NAME, Manifest
from ...storage import open_store
from ...storage.base import Store
from ..agreement import raise_if_any_rank_failed
from ..job import JobState
from ..retention import apply_retention
from ..step_layout import child_uri, step_dir_name
from ..timeline import PersistRecord, TimelineSink
from .file_moves import copy_file

__all__ = ["PersistJob", "Persister"]

logger = logging.getLogger("goodput_ckpt.tiers")


@dataclass(frozen=True)
class PersistJob:
    """What one persist copies: ``step``'s committed manifest (its bytes and its parse)."""

    step: int
    record: bytes
    manifest: Manifest
    #: The step's save number (``..job``; 0: unknown).
    save: int = 0


class Persister:
    """The persistent tier of one two-tier manager (every rank has one).

    Args:
        root_uri / storage_options: the persistent root and its backend options.
        local: the node-local root (this rank's node).
        rank / world_size: this rank in ``pg``.
        pg: the persist thread's own group (``None``: one process).
        keep_last, overwrite: as the manager's, for the persistent tier.
        timeline: where each persist's record goes.
        on_failure: ``on_failure(step, error)`` on this rank when a persist failed.
    """

    def __init__(
        self,
        *,
        root_uri: str,
        storage_options: dict[str, Any],
        local: Store,
        rank: int,
        world_size: int,
        pg: dist.ProcessGroup | None,
        keep_last: int | None,
        overwrite: bool,
        timeline: TimelineSink,
        on_failure: Callable[[int, CheckpointError], None],
        job: JobState,
    ) -> None:
        self.root_uri = root_uri
        self.storage_options = storage_options
        self.root = open_store(root_uri, storage_options)
        self.local = local
        self.rank, self.world_size, self.pg = rank, world_size, pg
        self.group = Group(pg, world_size)
        self.keep_last, self.overwrite = keep_last, overwrite
        self._timeline = timeline
        self._on_failure = on_failure
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="goodput-ckpt-persist")
        self._running: Future | None = None
        self._step: int | None = None
        self._lock = threading.Lock()
        self._job = job
        #: The save number of the last step that persisted, for when the one in flight fails.
        self._confirmed_save = job.persisted_save

    @property
    def persisted_save(self) -> int:
        """The save number of the newest step handed to this tier (``..job``): the count of
        saves not yet persisted starts from it. A failed persist gives back the last one that
        succeeded, so the next save is persisted instead of ``persist_every`` later."""
        return self._job.persisted_save

    @property
    def in_flight_step(self) -> int | None:
        """The step being persisted now, or ``None`` (the local tier keeps it until done)."""
        with self._lock:
            return self._step if self._running is not None and not self._running.done() else None

    def submit(self, job: PersistJob) -> None:
        """Start persisting ``job`` (after the previous persist finished: see the module doc)."""
        self.wait()
        with self._lock:
            if job.save:
                self._job.persisted_save = job.save
            self._step = job.step
            self._running = self._worker.submit(self._persist, job)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the persist in flight (its failure is reported through ``on_failure``)."""
        fut = self._running
        if fut is not None:
            fut.result(timeout=timeout_s)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)

    # -- the persist thread ---------------------------------------------------------------------
    def _persist(self, job: PersistJob) -> None:
        started, t0 = time.time(), time.perf_counter()
        where = child_uri(self.root_uri, step_dir_name(job.step))
        err: CheckpointError | None = None
        nbytes = 0
        try:
            dst = open_store(where, self.storage_options)
            raise_if_any_rank_failed(self.group, self._clear(dst))
            dst.prepare()
            src = open_store(child_uri(self.local.uri, step_dir_name(job.step)), {})
            keys = KeyIndex(job.manifest)
            for entry in job.manifest.files.values():
                if data_file_rank(entry.path) == self.rank:
                    copy_file(src, dst, entry, job.manifest.chunk_size, keys=keys)
                    nbytes += entry.size
            durable_future(dst).result()
            raise_if_any_rank_failed(self.group, None)
            raise_if_any_rank_failed(self.group, self._commit(dst, job))
        except BaseException as e:  # noqa: BLE001 - reported, never raised in this thread
            err = as_checkpoint_error(e, f"persisting step {job.step} to {where}")
        if err is None and self.rank == 0:
            apply_retention(self.root, committed=job.step, keep_last=self.keep_last)
        self._timeline.emit(
            PersistRecord(
                step=job.step,
                rank=self.rank,
                world_size=self.world_size,
                time=started,
                seconds=time.perf_counter() - t0,
                bytes=nbytes,
                error=None if err is None else str(err),
            )
        )
        if err is not None:
            with self._lock:
                if self._job.persisted_save == job.save:
                    self._job.persisted_save = self._confirmed_save
            self._on_failure(job.step, err)
        else:
            with self._lock:
                self._confirmed_save = max(self._confirmed_save, job.save)
            logger.info("persisted step %d to %s", job.step, where)

    def _clear(self, dst: Store) -> CheckpointError | None:
        """Coordinator: refuse (or, with ``overwrite``, clear) a committed step already there."""
        if self.rank != 0:
            return None
        try:
            clear_or_refuse_existing(dst, self.overwrite)
        except CheckpointError as e:
            return e
        return None

    def _commit(self, dst: Store, job: PersistJob) -> CheckpointError | None:
        if self.rank != 0:
            return None
        try:
            dst.put_commit_record(MANIFEST_NAME, job.record, replace=self.overwrite)
            durable_future(dst).result()
        except CheckpointError as e:
            return e
        return None
