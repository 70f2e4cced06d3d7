"""What one save writes and with what: the state, the job's save number, the writer of the chain's
first tier and the timeline record, built on every rank before anything is written.

``CheckpointManager.save`` calls :func:`prepare_save` once it has waited for the previous save
and checked that the step is new; the :class:`~.save_job.SaveJob` it returns then goes to the
save thread (async, after staging) or is written at once. Either way the chain
(:mod:`.chain`) spreads it afterwards (``Chain.after_write``). The save flow, top-down:
``docs/architecture.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from ..dcp.writer import CheckpointWriter
from ..state import Topology, build_save_state, check_stateful, normalize
from ..storage.base import StaleUploads, Store
from .config import ManagerConfig
from .incremental_saves import IncrementalSaves
from .job import JobState, job_metadata
from .save_job import SaveJob
from .staging.confirmed_writer import ConfirmedWriter
from .timeline import SaveRecord, tensor_nbytes

__all__ = ["prepare_save"]


def prepare_save(
    step: int,
    *,
    uri: str,
    options: dict[str, Any],
    model: Any,
    optimizer: Any,
    dataloader: Any,
    extra: Mapping[str, Any] | None,
    stateful: Mapping[str, Any],
    config: ManagerConfig,
    topology: Topology,
    job: JobState,
    root: Store,
    started: float,
    waited_s: float,
    incremental: IncrementalSaves | None = None,
) -> tuple[SaveJob, dict[str, Any], Any]:
    """The save of ``step`` to ``uri`` (the chain's first tier, with its store ``options``): the
    job, the state dict to write (live tensors: stage or write them before training goes on)
    and the normalized models (what staging copies behind the next step).

    Before the job's first save the coordinator records the job at ``root`` (``job.claim``), and
    every save takes the next save number, also a failed one's: persists come early, never late.
    With ``incremental`` (``CheckpointManager(incremental=...)``) the writer writes only what
    changed since this rank's last committed save and references the rest.

    Raises:
        TypeError / ValueError: bad arguments (``extra`` not JSON, a reserved name ...).
        CheckpointError: the root was claimed by another job, or the writer cannot be made.
    """
    models = normalize(model, optimizer)
    check_stateful(stateful)
    state, metadata = build_save_state(
        step,
        models=models,
        dataloader=dataloader,
        stateful=stateful,
        topology=topology,
        save_rng=config.save_rng,
        extra=extra,
    )
    job.claim(root, topology.rank == 0)
    metadata.update(job_metadata(job.id, job.next_save))
    job.next_save += 1
    options = stale_uploads_once(root, uri, options, coordinator=topology.rank == 0)
    # An async save commits only if every rank's deferred copies are good (staging/confirmed_writer.py).
    # known_new: the caller refused the steps it knows of (ExistingSteps), so on S3 the writer
    # does not list the step's location before the save (issue 37); its commit still refuses a
    # record there, and retention removes files of failed saves of the step (step_leftovers.py).
    writer_options = dict(
        thread_count=config.thread_count,
        chunk_size=config.chunk_size,
        overwrite=config.overwrite,
        known_new=not config.overwrite,
        metadata=metadata,
        **options,
    )
    if incremental is not None:
        writer_options["reuse"] = incremental.plan(step, state, models)
    writer_cls = ConfirmedWriter if config.async_save else CheckpointWriter
    writer = writer_cls(uri, **writer_options)
    record = SaveRecord(
        step=step,
        rank=topology.rank,
        world_size=topology.world_size,
        time=started,
        is_async=config.async_save,
        wait_s=waited_s,
        bytes=tensor_nbytes(state),
    )
    return SaveJob(step, uri, writer, record), state, models


#: The roots (one per manager) whose stale uploads were cleaned at their manager's first save.
_cleaned_roots: weakref.WeakSet[Any] = weakref.WeakSet()


def stale_uploads_once(root: Store, uri: str, options: dict[str, Any], *, coordinator: bool) -> dict[str, Any]:
    """The options of a step's writer, without its per-save stale-upload clean-up where the
    manager does it once for the whole root instead.

    Why (issue 37): a writer's clean-up lists the multipart uploads of its own location before
    every save: one ``ListMultipartUploads`` per save, for a step directory that is new at almost
    every save, so it almost never finds anything. Uploads are left open only by a killed save,
    and a killed save kills the job (its collectives fail); the manager of the restarted job
    cleans every step of the root once, at its first save (uploads idle for the root's
    ``stale_upload_age``, recursive), and its restore aborts every open upload under the root
    (``retention.clean_before_restore``). On S3 (the first tier is the root itself) the step
    writers then skip theirs; with a local first tier nothing changes.
    """
    if not isinstance(root, StaleUploads) or not uri.startswith("s3://"):
        return options
    if coordinator and root not in _cleaned_roots:
        root.abort_stale_uploads_before_save(recursive=True)
        _cleaned_roots.add(root)
    return {**options, "stale_upload_age": None}
