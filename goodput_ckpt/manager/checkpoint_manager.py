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

This module is the public class: it checks the arguments, builds the state and calls those
pieces in order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..dcp.load_planner import GridLoadPlanner
from ..engine.manifest_load import load_manifest
from ..dcp.reader import CheckpointReader
from ..dcp.writer import CheckpointWriter
from ..errors import OVERWRITE_HINT, CheckpointError, CheckpointExistsError, as_checkpoint_error
from ..state import (
    EXTRA_KEY,
    Topology,
    apply_restore,
    build_save_state,
    check_stateful,
    normalize,
    plan_restore,
)
from ..state.apply import DecodedState, decode_restore, split_dest
from ..state.per_rank import DATALOADER, ROWS
from ..state.loader_share import share_key, share_loader_states
from ..storage import open_store
from ..storage.base import FileOrigin
from .agreement import (
    agree_on_latest,
    decide_on_coordinator,
    deliberate_no_dist,
    fail_on_every_rank,
    open_group,
    raise_if_any_rank_failed,
    union_of_steps,
)
from .config import ManagerConfig
from .disk_full import make_room
from .job import JobRecord, JobState, claim_job_file, job_metadata, job_of, survey_job
from .incremental_saves import IncrementalSaves
from .retention import apply_retention, scan_steps
from .save_job import ErrorCallback, SaveJob, SaveJobs
from .staging.async_staging import AsyncStaging
from .staging.confirmed_writer import ConfirmedWriter
from .step_layout import child_uri, step_dir_name
from .tiers import Tiers
from .tiers.nodes import local_root
from .timeline import TIMELINE_NAME, RestoreRecord, SaveRecord, TimelineSink, tensor_nbytes

__all__ = ["CheckpointManager", "ManagerConfig"]

logger = logging.getLogger("goodput_ckpt.manager")

#: The DCP keys of the per-rank dataloader states (``dataloader.rows``, a row per rank, or
#: schema 1's ``dataloader.rank{r}``, see ``state.bundle``).
LOADER_KEY_PREFIX = f"{DATALOADER}."
LOADER_ROWS = f"{DATALOADER}.{ROWS}"


def _share_agreement(plan: Any) -> tuple[str, Any]:
    """What every rank's restore plan must agree on before the load (``agreement``): whether, and
    how much, old loader state the coordinator broadcasts after it (``state.loader_share``)."""
    return "the old ranks' loader states of an elastic restore (count, bytes)", share_key(plan)


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
        incremental: write only the tensors that changed since the last committed save of this
            process and reference the others in the earlier step that holds them
            (:mod:`goodput_ckpt.dcp.incremental`; retention keeps a step while a kept step
            references it). ``True``: every 10th save is full; an integer ``n``: every ``n``-th.
            One tier only, and not with ``overwrite`` (both are refused).
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
            keep_last=keep_last, async_save=async_save, async_staging=async_staging, fail_fast=fail_fast, save_rng=save_rng,
            allow_topology_change=allow_topology_change, overwrite=overwrite, thread_count=thread_count,
            chunk_size=chunk_size, verify=verify, timeout_s=timeout_s,
            local_dir=None if local_dir is None else os.fspath(local_dir), replicas=replicas,
            persist_every=persist_every, local_keep_last=local_keep_last, free_space_on_full=free_space_on_full,
            incremental=incremental,
        )  # fmt: skip
        if on_error is not None and not callable(on_error):
            raise TypeError("on_error must be callable(step, error)")
        self.root_uri = os.fspath(root_uri)
        self._storage_options = dict(storage_options)
        self._root = open_store(self.root_uri, self._storage_options)  # checks the options now
        self._timeline = TimelineSink(self._timeline_target(timeline))
        self._staging = AsyncStaging(defer=self.config.async_staging, timeout_s=self.config.timeout_s)
        self._closed = False
        self._pg, self._own_pg = open_group(process_group)
        if self._pg is not None:
            self._topology = Topology(rank=dist.get_rank(self._pg), world_size=dist.get_world_size(self._pg))
        else:
            self._topology = Topology(rank=0, world_size=1)
        self._tiers: Tiers | None = None
        self._job: JobState = self._survey_job()
        self._steps_seen: set[int] | None = None  # committed steps listed at the first save, every rank
        self._incremental = IncrementalSaves.open(self.config.incremental)  # None: every save is full
        self._saves = SaveJobs(
            pg=self._pg, staging=self._staging, timeline=self._timeline, timeout_s=self.config.timeout_s,
            on_commit=self._apply_retention, on_error=on_error,
            after_write=None if self.config.local_dir is None else self._after_local_write,
            make_room=self._make_room if self.config.free_space_on_full else None,
        )  # fmt: skip
        if self.config.local_dir is not None:
            self._tiers = Tiers.open(
                self.config, root_uri=self.root_uri, storage_options=self._storage_options, pg=self._pg,
                topology=self._topology, local_world_size=local_world_size, timeline=self._timeline,
                on_failure=self._saves.report_failure, job=self._job,
            )  # fmt: skip

    def _survey_job(self) -> JobState:
        """The job this manager's checkpoints belong to (:mod:`.job`), decided by the coordinator
        from the root's job file and the save numbers the tiers hold (one broadcast)."""
        local_dir = self.config.local_dir
        return decide_on_coordinator(
            self._pg, self.is_coordinator,
            lambda: survey_job(self._root, None if local_dir is None else local_root(local_dir, 0), lambda u: open_store(u, {})),
            f"reading the job identity of {self._root.uri}",
        )  # fmt: skip

    @property
    def job_id(self) -> str:
        """The id of the job whose checkpoints this manager saves and restores (:mod:`.job`):
        the one recorded at the root, or a new one that the first save records there."""
        return self._job.id

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
    def last_error(self) -> CheckpointError | None:
        """The most recent failure of a background save, or ``None``."""
        return self._saves.last_error

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """This rank's newest timeline records (see :mod:`goodput_ckpt.manager.timeline`), oldest first."""
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
        return self._saves.in_flight_step

    def steps(self) -> list[int]:
        """The steps that hold a complete (committed) checkpoint, ascending. With two tiers: the
        steps this rank sees committed on its node's local tier or on the persistent tier
        (:meth:`step_tiers` says which)."""
        if self._tiers is not None:
            return list(self._tiers.step_tiers())
        return scan_steps(self._root).complete

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Step -> the tiers holding a committed copy of it, seen from this rank (``"local"``:
        this node's directory, ``"persistent"``: the root). One tier: every step is persistent."""
        if self._tiers is not None:
            return self._tiers.step_tiers()
        return {s: ("persistent",) for s in scan_steps(self._root).complete}

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_uri(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (for ``CheckpointReader`` or the tools): on the
        persistent tier (with two tiers, only persisted steps are complete there)."""
        return child_uri(self.root_uri, step_dir_name(step))

    def extra(self, step: int) -> dict[str, Any]:
        """The ``extra`` metadata saved with ``step``.

        Raises:
            CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
        """
        if self._tiers is not None and step in self._tiers.step_tiers() and "local" in self._tiers.step_tiers()[step]:
            manifest = load_manifest(open_store(self._tiers.step_uri(step), {}))
        else:
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
        if self._tiers is not None:  # every save goes to the node-local tier first
            uri, options = self._tiers.step_uri(step), {}
        else:
            uri, options = child_uri(self.root_uri, step_dir_name(step)), self._storage_options
        started, t0 = time.time(), time.perf_counter()
        self._saves.finish_previous(report=False)
        if self.config.fail_fast and (failed := self._saves.take_unraised()) is not None:
            # Maybe a failure of this rank only (an upload's durability): fail this step everywhere.
            fail_on_every_rank(self._pg, uri, failed, options)
            raise failed
        if not self.config.overwrite:
            self._refuse_existing(step, uri)
        t_waited = time.perf_counter()
        try:
            models = normalize(model, optimizer)
            check_stateful(stateful)
            state, metadata = build_save_state(
                step, models=models, dataloader=dataloader, stateful=stateful, topology=self._topology,
                save_rng=self.config.save_rng, extra=extra,
            )  # fmt: skip
            self._claim_root()
            metadata.update(job_metadata(self._job.id, self._job.next_save))
            self._job.next_save += 1  # a failed save's number is not reused: persists come early, never late
            writer_options = dict(
                thread_count=self.config.thread_count, chunk_size=self.config.chunk_size,
                overwrite=self.config.overwrite, metadata=metadata, **options,
            )  # fmt: skip
            if self._incremental is not None:
                writer_options["reuse"] = self._incremental.plan(step, state, models)
            # An async save commits only if every rank's deferred copies are good
            # (staging/confirmed_writer.py).
            writer_cls = ConfirmedWriter if self.config.async_save else CheckpointWriter
            writer = writer_cls(uri, **writer_options)
        except Exception as e:
            fail_on_every_rank(self._pg, uri, e, options)
            raise
        record = SaveRecord(
            step=step, rank=self._topology.rank, world_size=self._topology.world_size, time=started,
            is_async=self.config.async_save, wait_s=t_waited - t0, bytes=tensor_nbytes(state),
        )  # fmt: skip
        job = SaveJob(step, uri, writer, record)
        if not self.config.async_save:
            self._saves.save_now(job, state, blocked_from=t0, started=t_waited)
            return
        try:  # the only part of an async save that blocks
            staged, later = self._staging.stage(state, models)
        except BaseException as e:
            if isinstance(e, (Exception, CheckpointException)):
                err = as_checkpoint_error(e, f"staging step {step}")
                fail_on_every_rank(self._pg, uri, err, options)
                raise err from e
            raise
        del state
        self._saves.submit(job, staged, later, blocked_from=t0, waited=t_waited)

    def _refuse_existing(self, step: int, uri: str) -> None:
        """Raise ``CheckpointExistsError`` on every rank alike when ``step`` is committed on some
        tier, at the call (a background save would fail only at its commit, reported at
        ``close()``). No collective per save: the steps listed at the first save (one gather,
        :func:`.agreement.union_of_steps`) and those this manager saved since are the same on
        every rank. A step saved by another process meanwhile still fails at its commit."""
        if self._steps_seen is None:
            layout = None if self._tiers is None else self._tiers.local.layout
            lists = self.is_coordinator or (layout is not None and layout.rank == layout.ranks_of(layout.node)[0])
            self._steps_seen = union_of_steps(self._pg, self._topology.world_size, self.steps if lists else None)
        if step in self._steps_seen or step in self._saves.committed:
            raise CheckpointExistsError(
                f"step {step} already has a committed checkpoint ({self._root.uri}"
                f"{'' if self._tiers is None else ' or the local tier'}): {OVERWRITE_HINT}, or save another step",
                path=uri,
            )

    def _claim_root(self) -> None:
        """Before the job's first save: the coordinator records the job's id at the root."""
        if self._job.recorded:
            return
        if self.is_coordinator:
            found = claim_job_file(self._root, self._job.id)
            if found != self._job.id:
                raise CheckpointError(
                    f"{self._root.uri} was claimed by another job (id {found}) after this one started: "
                    "two jobs cannot share a root",
                    path=self._root.uri,
                )
        self._job.recorded = True

    def _restored(self, job: JobRecord) -> None:
        """After a step of ``job`` was restored: this job's saves go on from its save number."""
        if job.id == self._job.id and job.save is not None:
            self._job.next_save = job.save + 1
            self._job.persisted_save = min(self._job.persisted_save, job.save)

    def wait_staged(self) -> None:
        """Finish the background staging copies of the save in flight, in this thread.

        Call it before changing parameters or optimizer states in place other than through an
        optimizer's ``step()`` (which waits by itself) while a save may still be staging.
        """
        self._staging.finish_pending()

    # -- retention ----------------------------------------------------------------------------------
    def _apply_retention(self, committed: int) -> None:
        """Coordinator, after ``committed`` was committed and with no other save in flight
        (policy: :mod:`.retention`; the save thread calls it, on every rank). Best effort: failures
        are logged."""
        if self._incremental is not None:
            self._incremental.committed(committed)  # its stored pieces become the next save's base
        if self.is_coordinator and self._tiers is None:  # two tiers: each tier applies its own
            apply_retention(self._root, committed=committed, keep_last=self.config.keep_last)

    def _make_room(self, job: SaveJob) -> bool:
        """Every rank, after a save failed, with ``free_space_on_full``: see :mod:`.disk_full`."""
        rank, world = self._topology.rank, self._topology.world_size
        if self._tiers is None:
            return make_room(
                self._pg, self._root, rank=rank, world_size=world, owner_of=dict.fromkeys(range(world), 0),
                step=job.step, needed=job.record.bytes,
            )  # fmt: skip
        local = self._tiers.local
        persisting = local.persister.in_flight_step if local.persister is not None else None
        return make_room(
            self._pg, local.store, rank=rank, world_size=world, step=job.step, needed=job.record.bytes,
            owner_of={r: local.layout.ranks_of(local.layout.node_of(r))[0] for r in range(world)},
            protect={persisting} - {None},
        )  # fmt: skip

    def _after_local_write(self, job: SaveJob, err: CheckpointError | None) -> CheckpointError | None:
        """Two tiers, the save thread, every rank: spread the local save (manifest to every node,
        replicas, persist hand-off, local retention). Never raises."""
        assert self._tiers is not None
        err, replicate_s = self._tiers.local.after_save(job.step, err)
        job.record.tier, job.record.replicate_s = "local", replicate_s
        return err

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
        try:
            return self._restore(step, models, dataloader, stateful)
        except BaseException:
            models.discard_shaped_state()  # a fresh optimizer stays fresh (state/optim_state.py)
            raise

    def _restore(self, step: int | None, models: Any, dataloader: Any, stateful: Mapping[str, Any]) -> int | None:
        """:meth:`restore` once its arguments are checked."""
        if self._tiers is not None:
            self._tiers.wait(self.config.timeout_s)  # and a persist in flight
            return self._restore_tiers(step, models=models, dataloader=dataloader, stateful=stateful)
        if step is None:
            step = self._agree_on_latest()
            if step is None:
                return None
        started, t0 = time.time(), time.perf_counter()
        uri = child_uri(self.root_uri, step_dir_name(step))

        def reader(manifest: Any = None) -> CheckpointReader:
            return CheckpointReader(
                uri, verify=self.config.verify, thread_count=self.config.thread_count, process_group=self._pg,
                manifest=manifest, **self._storage_options,
            )  # fmt: skip

        first = reader()
        plan, job, local_err, manifest = None, None, None, None
        try:
            manifest = first.shared_manifest()  # one read, not one per rank
            job = job_of(manifest, uri)  # checked before anything is loaded
            plan = self._plan(manifest, uri, models, dataloader, stateful)
        except CheckpointError as e:
            local_err = e
        reads_rows = plan is not None and bool(split_dest(plan)[0])
        told = raise_if_any_rank_failed(
            self._pg, self._topology.world_size, local_err, agree=_share_agreement(plan), tell=reads_rows
        )  # fmt: skip
        assert plan is not None and job is not None
        what = f"loading step {step} from {uri}"
        # Two loads: the per-rank rows first, decoded and checked on every rank, and only then
        # the tensors, read into the live ones (state/apply.py). A rank without rows still joins
        # the first dcp.load when another rank reads some: its collectives pair them.
        if any(told):
            self._read(split_dest(plan)[0], first, what)
        decoded = self._decode(plan)
        second = reader(manifest)  # the manifest read above, not read again
        self._read(split_dest(plan)[1], second, what)
        self._apply(step, uri, plan, decoded, [first, second], started, t0, None)
        self._restored(job)
        return step

    def _plan(self, manifest: Any, where: str, models: Any, dataloader: Any, stateful: Mapping[str, Any]) -> Any:
        return plan_restore(
            manifest, where=where, models=models, dataloader=dataloader, stateful=stateful,
            topology=self._topology, allow_topology_change=self.config.allow_topology_change,
        )  # fmt: skip

    def _decode(self, plan: Any) -> DecodedState:
        """Every rank, once the per-rank rows are read and before any live tensor is: share an
        elastic restore's old loader states, decode and check this rank's state, and raise on
        every rank when some rank's does not decode (then nothing was loaded anywhere)."""
        share_loader_states(plan, self._pg)  # elastic: the coordinator's old loader states to all
        decoded, err = None, None
        try:
            decoded = decode_restore(plan)
        except CheckpointError as e:
            err = e
        raise_if_any_rank_failed(self._pg, self._topology.world_size, err)
        assert decoded is not None
        return decoded

    def _read(self, dest: dict[str, Any], reader: CheckpointReader, what: str, *, local: bool = False) -> None:
        """``dcp.load`` of ``dest`` (a part of a plan's destination, :func:`.state.split_dest`)
        through ``reader``: every rank together, over the manager's group.

        ``local``: each rank loads on its own, with none of ``dcp.load``'s collectives (the plan
        gather and scatter, which ``GridLoadPlanner`` leaves empty for a v2 checkpoint, and the
        read phase's gather). For a caller that gathers every rank's outcome itself right after,
        as the two-tier restore does; without that gather, a rank's failure would not reach the
        others.
        """
        no_dist = deliberate_no_dist(self._pg is None or local)
        try:
            dcp.load(dest, storage_reader=reader, planner=GridLoadPlanner(), process_group=self._pg, no_dist=no_dist)
        except (Exception, CheckpointException) as e:
            raise as_checkpoint_error(e, what)

    def _apply(
        self, step: int, uri: str, plan: Any, decoded: DecodedState, readers: list[CheckpointReader], started: float,
        t0: float, sources: dict[str, int] | None,
    ) -> None:  # fmt: skip
        """Every rank, after both loads: apply ``plan``, record the restore, report its notes."""
        apply_restore(plan, decoded)  # this rank's rows were decoded and checked before the tensors were read
        loader_states = None
        if plan.dataloader is not None:
            loader_states = sum(
                r.rows_read[LOADER_ROWS]
                + sum(n for k, n in r.keys_read.items() if k.startswith(LOADER_KEY_PREFIX) and k != LOADER_ROWS)
                for r in readers
            )  # fmt: skip
        self._timeline.emit(
            RestoreRecord(
                step=step, rank=self._topology.rank, world_size=self._topology.world_size, time=started,
                seconds=time.perf_counter() - t0, bytes=tensor_nbytes(plan.dest), sources=sources,
                loader_states=loader_states,
            )  # fmt: skip
        )
        for note in plan.notes:  # one channel: the log (docs/manager.md, "What a restore reports")
            logger.warning("restore of step %d: %s", step, note)
        logger.info("restored step %d from %s", step, uri)

    def _restore_tiers(self, step: int | None, *, models: Any, dataloader: Any, stateful: Mapping[str, Any]) -> int | None:
        """Two tiers: agree on a step every rank can rebuild, fetch what is missing from the next
        tier, and load from this node's copy, each chunk checked as it is read
        (:mod:`.tiers.restore`): the per-rank rows first, then, once they are decoded on every
        rank, the tensors."""
        assert self._tiers is not None
        started, t0 = time.time(), time.perf_counter()
        readers: dict[int, CheckpointReader] = {}  # part -> its last load's reader (what the record counts)
        decoded: list[DecodedState] = []

        def load(part: int, plan: Any, where: str, checked: set[str], manifest: Any, read_from: dict[str, FileOrigin]) -> None:
            if part == 0:
                readers.clear()  # a new candidate, or the rows again after a repair
            dest = split_dest(plan)[part]
            if not dest:
                return  # a rank without rows to read (the others' outcomes are gathered all the same)
            reader = CheckpointReader(
                where, verify=self.config.verify, thread_count=self.config.thread_count, process_group=self._pg, partial=True,
                checked_files=checked, manifest=manifest, read_from=read_from,
            )  # fmt: skip
            readers[part] = reader
            try:
                # Local: restore_tiers gathers every rank's outcome right after (_load_checked).
                self._read(dest, reader, f"loading {where}", local=True)
            finally:
                reader.read_from = {}  # chunks received into memory are freed now, not when the restore returns

        def load_and_check(part: int, plan: Any, *args: Any) -> None:
            load(part, plan, *args)
            if part == 0 and not plan.elastic_from:
                # This rank's own state decodes alone: its outcome rides on the load's gather.
                decoded.append(decode_restore(plan))

        def between(plan: Any) -> None:
            if plan.elastic_from:  # agreed by every rank: the old states are shared, then checked
                decoded.append(self._decode(plan))

        found = self._tiers.restore(
            step, plan_for=lambda manifest, where: self._plan(manifest, where, models, dataloader, stateful),
            dest_of=lambda plan: plan.dest, load=load_and_check, agree_of=_share_agreement, decode=between,
        )  # fmt: skip
        if found is None:
            return None
        choice, plan = found
        where = self._tiers.step_uri(choice.step)
        self._apply(choice.step, where, plan, decoded[-1], list(readers.values()), started, t0, choice.sources)
        self._restored(job_of(choice.manifest, where))  # checked by the tiers' restore
        return choice.step

    def _agree_on_latest(self) -> int | None:
        """The step every rank restores: the coordinator's choice (:func:`.agreement.agree_on_latest`)."""
        return agree_on_latest(
            self._root, self._pg, is_coordinator=self.is_coordinator, keep_last=self.config.keep_last,
            root_uri=self._root.uri,
        )  # fmt: skip

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
        if self._tiers is not None:
            self._tiers.wait(self.config.timeout_s)
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
            if self._tiers is not None:
                self._tiers.wait(self.config.timeout_s)
            self._saves.finish_previous(report=True)
        finally:
            self._closed = True
            self._saves.shutdown()
            if self._tiers is not None:
                self._tiers.close()
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

