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

An incremental step (its manifest names ``base`` steps that hold some of its files) is
persisted with the same manifest, so its references must resolve on the persistent tier too:
each base not yet committed there is persisted first (:func:`missing_bases`, oldest first,
and the bases those reference), and only the files the step itself holds are copied. A base
already committed there is checked to hold the referenced files with the same sizes and
digests, and is never copied again: a persist sends only what the persistent tier lacks.
Retention there keeps a base while a kept step references it (``..step_references``). A crash
between the persist of a base and the step's own leaves the base as an ordinary complete
checkpoint of the job (it was committed locally): nothing committed ever references a
missing file.
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
from ...format.commit_record import COMMITTED, KeyIndex, read_commit_record
from ...format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ...storage import open_store
from ...storage.base import Store
from ..agreement import raise_if_any_rank_failed
from ..job import JobState
from ..retention import apply_retention
from ..step_layout import child_uri, parse_step_dir, step_dir_name
from ..timeline import PersistRecord, TimelineSink
from .file_moves import copy_file

__all__ = ["PersistJob", "Persister", "missing_bases"]

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
            bases: Any = None
            if self.rank == 0:  # the bases the persistent tier lacks, read once, told to every rank
                try:
                    bases = missing_bases(job, self.root, self.local)
                except CheckpointError as e:
                    bases = str(e)
            bases = self.group.broadcast(bases)
            if isinstance(bases, str):
                raise CheckpointError(f"persisting the bases of step {job.step}: {bases}")
            for base in bases:  # oldest first: each one's own bases are already there
                nbytes += self._copy_step(base)
            nbytes += self._copy_step(job)
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

    def _copy_step(self, job: PersistJob) -> int:
        """Copy this rank's files of ``job``'s step from its node's copy, every rank together,
        and commit it (the coordinator); the bytes this rank copied. Referenced files are not
        copied: their base is committed on the persistent tier already (:func:`missing_bases`).

        Raises:
            CheckpointError: on every rank, when any rank failed.
        """
        dst = open_store(child_uri(self.root_uri, step_dir_name(job.step)), self.storage_options)
        raise_if_any_rank_failed(self.group, self._clear(dst))
        dst.prepare()
        src = open_store(child_uri(self.local.uri, step_dir_name(job.step)), {})
        keys = KeyIndex(job.manifest)
        nbytes = 0
        for entry in job.manifest.files.values():
            if entry.base is None and data_file_rank(entry.path) == self.rank:
                copy_file(src, dst, entry, job.manifest.chunk_size, keys=keys)
                nbytes += entry.size
        durable_future(dst).result()
        raise_if_any_rank_failed(self.group, None)
        raise_if_any_rank_failed(self.group, self._commit(dst, job))
        return nbytes

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


#: Bases followed per persist (each a step of the job): a bound on a chain read from manifests.
MAX_BASES = 4096


def missing_bases(job: PersistJob, root: Store, local: Store) -> list[PersistJob]:
    """The steps ``job``'s step references (directly or through one another) that ``root``, the
    persistent tier, does not hold committed, as persists read from the node-local tier
    ``local``, oldest first (the coordinator, before the persist of ``job``).

    A base committed on ``root`` must hold each referenced file with the size and chunk
    digests the referencing manifest records (a reference never points at other bytes).

    Raises:
        CheckpointError: a base is neither on ``root`` nor readable on ``local`` (retention
            keeps it there while a kept step references it), ``root`` holds other bytes under a
            referenced name, or a base is not a step directory.
    """
    todo: list[tuple[Manifest, int]] = [(job.manifest, job.step)]
    out: dict[int, PersistJob] = {}
    seen: set[int] = set()
    while todo:  # bounded: each base step is visited once, at most MAX_BASES of them
        manifest, step = todo.pop()
        for name in sorted(manifest.bases()):
            base = parse_step_dir(name)
            if base is None or base == step:
                raise CheckpointError(f"step {step} references {name!r}, which is not another step of this root")
            referenced = [f for f in manifest.files.values() if f.base == name]
            if base in seen:
                continue
            seen.add(base)
            if len(seen) > MAX_BASES:
                raise CheckpointError(f"step {job.step} references more than {MAX_BASES} earlier steps")
            held = read_commit_record(root, name, count_files=False)
            if held.status == COMMITTED and held.manifest is not None:
                _check_same_files(held.manifest, referenced, f"{root.uri}/{name}")
                continue
            data = local.read_small(f"{name}/{MANIFEST_NAME}")
            base_manifest = parse_manifest(data, location=f"{local.uri}/{name}")
            _check_same_files(base_manifest, referenced, f"{local.uri}/{name}")
            out[base] = PersistJob(base, data, base_manifest, 0)  # save 0: not a persist of its own
            todo.append((base_manifest, base))
    return [out[s] for s in sorted(out)]


def _check_same_files(holder: Manifest, referenced: list[Any], where: str) -> None:
    """``holder`` (a base's manifest) lists each referenced file as a file of its own, with the
    same size and digests."""
    for f in referenced:
        own = holder.files.get(f.path)
        if own is None or own.base is not None or own.size != f.size or own.chunks != f.chunks:
            raise CheckpointError(
                f"{where} does not hold {f.path} as the referencing step records it (size {f.size}): "
                "another save of that step number is there"
            )
