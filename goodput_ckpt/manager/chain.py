"""A job's storage as a chain of tiers: ``[persistent]``, or ``[local, replicas, persistent]``.

The manager holds one :class:`Chain` and runs one save path and one restore path over it
(``docs/architecture.md``): a save writes where :meth:`Chain.save_target` says, and the save
thread then calls :meth:`Chain.after_write` (spread the save down the chain) and
:meth:`Chain.apply_retention` (on the persistent chain it hands the step to a retention thread:
:mod:`.background_retention`); a restore hands the chain one :class:`~.restoring.RestoreTarget`
and gets back what it chose and loaded (:meth:`Chain.restore`).

Two chains exist:

- :class:`PersistentChain` (this module): every save goes to the root; a restore agrees on the
  newest complete step (or the one asked for) and loads it from the root, refusing rather than
  falling back when it is damaged.
- ``tiers.Tiers`` (``local_dir=``): every save goes to the node-local tier first, replicas go
  to other nodes, and every ``persist_every``-th save to the root in the background; a restore
  takes the newest step every rank can rebuild, each file from its nearest intact copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..dcp.collectives import Group
from ..dcp.read_sources import ReadSources
from ..errors import CheckpointError
from ..format.manifest import Manifest
from ..state import Topology
from ..storage import open_store
from ..storage.base import Store
from .agreement import agree_on_latest, decide_on_coordinator, raise_if_any_rank_failed
from .background_retention import BackgroundRetention
from .config import ManagerConfig
from .disk_full import make_room
from .job import JobState, job_of, survey_job
from .restoring import ROWS_PART, TENSORS_PART, Restored, RestoreTarget
from .retention import scan_steps
from .save_job import SaveJob
from .step_layout import child_uri, step_dir_name
from .tiers import Tiers
from .tiers.nodes import local_root
from .timeline import TimelineSink

__all__ = ["Chain", "PersistentChain", "agree_on_job", "open_chain"]

PERSISTENT = "persistent"


class Chain(Protocol):
    """The tiers of one job's storage, seen from one rank. Every rank holds one and makes every
    call the manager makes (those marked collective pair the ranks)."""

    #: The tiers, nearest first: ``("persistent",)`` or ``("local", "replica", "persistent")``.
    names: tuple[str, ...]

    def save_target(self, step: int) -> tuple[str, dict[str, Any]]:
        """Where every save of ``step`` is written first, and the store options to write it with."""
        ...

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Step -> the tiers holding a committed copy of it, seen from this rank."""
        ...

    def manifest_store(self, step: int) -> Store:
        """The store whose commit record of ``step`` this rank reads (``extra``)."""
        ...

    def lists_steps(self) -> bool:
        """Whether this rank lists steps for the check of an existing step at the first save
        (the coordinator, and with two tiers each node's first rank)."""
        ...

    def after_write(self, job: SaveJob, err: CheckpointError | None) -> CheckpointError | None:
        """The save thread, every rank, after the write: spread the save down the chain (collective
        where there is anything to spread). Never raises: returns the save's error."""
        ...

    def apply_retention(self, committed: int) -> None:
        """The save thread, after ``committed`` was committed and is durable. Best effort."""
        ...

    def before_save(self, step: int) -> None:
        """Every rank, once the previous save is done and before a save of ``step`` writes:
        wait for a retention running beside the saves if it may delete ``step``."""
        ...

    def make_room(self, job: SaveJob) -> bool:
        """Every rank, after a save failed, with ``free_space_on_full`` (collective)."""
        ...

    def restore(self, step: int | None, target: RestoreTarget) -> Restored | None:
        """Every rank: choose a step, load it into ``target`` in its two parts (collective).
        ``None`` when ``step`` is ``None`` and nothing can be restored."""
        ...

    def wait(self, timeout_s: float | None) -> None:
        """Wait for what the chain still moves in the background (a persist)."""
        ...

    def close(self) -> None:
        """Stop the chain's background work and release its resources. Idempotent."""
        ...


class PersistentChain:
    """``[persistent]``: every save is written to the root (``ROOT/step_N``), and restored from it.

    Args:
        root: the root's store; ``root_uri``, ``storage_options``: what opened it.
        group: the manager's group; ``config``: the manager's settings.
    """

    names = (PERSISTENT,)

    def __init__(
        self, root: Store, root_uri: str, storage_options: dict[str, Any], group: Group, config: ManagerConfig
    ) -> None:
        self.root, self.root_uri, self.storage_options = root, root_uri, storage_options
        self.group, self.config = group, config
        # The coordinator retains the root on a thread of its own (off the save thread's path).
        self.retention = (
            BackgroundRetention(root, keep_last=config.keep_last, timeout_s=config.timeout_s)
            if group.rank == 0
            else None
        )

    def save_target(self, step: int) -> tuple[str, dict[str, Any]]:
        return child_uri(self.root_uri, step_dir_name(step)), self.storage_options

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        return {s: self.names for s in scan_steps(self.root).complete}

    def manifest_store(self, step: int) -> Store:
        return open_store(child_uri(self.root_uri, step_dir_name(step)), self.storage_options)

    def lists_steps(self) -> bool:
        return self.group.rank == 0

    def after_write(self, job: SaveJob, err: CheckpointError | None) -> CheckpointError | None:
        return err  # nothing below the root

    def apply_retention(self, committed: int) -> None:
        if self.retention is not None:
            self.retention.submit(committed)
            if not self.config.async_save:  # a synchronous save returns with everything done
                self.retention.drain()

    def before_save(self, step: int) -> None:
        if self.retention is not None:
            self.retention.before_save(step)

    def _drain(self) -> None:
        if self.retention is not None:
            self.retention.drain()

    def make_room(self, job: SaveJob) -> bool:
        self._drain()  # it deletes steps too
        owners = dict.fromkeys(range(self.group.world_size), 0)
        return make_room(self.group, self.root, owner_of=owners, step=job.step, needed=job.record.bytes)

    def restore(self, step: int | None, target: RestoreTarget) -> Restored | None:
        """The coordinator picks the newest complete step (or checks the one asked for) and
        reads its manifest for every rank; every rank plans, the ranks agree, and each loads the
        rows, then the tensors, from the root. A damaged step fails the restore: no fallback."""
        self._drain()  # nothing deletes the steps it reads
        records: dict[int, bytes] = {}  # what the clean-up read (coordinator): the newest record, once
        if step is None:
            step = self.latest(records)
            if step is None:
                return None
        uri = child_uri(self.root_uri, step_dir_name(step))
        first = target.reader(uri, **self.storage_options)
        plan, local_err, manifest = None, None, None
        try:
            manifest = first.shared_manifest(records.get(step))  # one read, not one per rank
            job_of(manifest, uri)  # checked before anything is loaded
            plan = target.plan(manifest, uri)
        except CheckpointError as e:
            local_err = e
        told = raise_if_any_rank_failed(
            self.group, local_err, agree=target.agreement(plan), tell=target.reads_rows(plan)
        )
        assert plan is not None and isinstance(manifest, Manifest)
        what = f"loading step {step} from {uri}"
        # A rank without rows still joins the rows' dcp.load when another rank reads some: its
        # collectives pair them.
        if any(told):
            target.read(ROWS_PART, plan, first, what)
        target.decode(plan)
        second = target.reader(uri, ReadSources(manifest=manifest), **self.storage_options)  # not read again
        target.read(TENSORS_PART, plan, second, what)
        return Restored(step, uri, manifest, plan)

    def latest(self, records: dict[int, bytes] | None = None) -> int | None:
        """Every rank: the newest complete step, the coordinator's choice (it cleans the root
        first: ``agreement.agree_on_latest``; ``records``: what that clean-up read)."""
        return agree_on_latest(self.root, self.group, keep_last=self.config.keep_last, records=records)

    def wait(self, timeout_s: float | None) -> None:
        self._drain()

    def close(self) -> None:
        if self.retention is not None:
            self.retention.close()


def open_chain(
    config: ManagerConfig,
    *,
    root: Store,
    root_uri: str,
    storage_options: dict[str, Any],
    group: Group,
    topology: Topology,
    local_world_size: int | None,
    timeline: TimelineSink,
    on_failure: Callable[[int, CheckpointError], None],
    job: JobState,
) -> Chain:
    """The chain ``config`` asks for: ``[persistent]``, or with ``local_dir`` the two tiers
    (``tiers.Tiers.open``: collective when there is a group)."""
    if config.local_dir is None:
        return PersistentChain(root, root_uri, storage_options, group, config)
    return Tiers.open(
        config,
        root_uri=root_uri,
        storage_options=storage_options,
        pg=group.pg,
        topology=topology,
        local_world_size=local_world_size,
        timeline=timeline,
        on_failure=on_failure,
        job=job,
    )


def agree_on_job(config: ManagerConfig, root: Store, group: Group) -> JobState:
    """The job a manager's checkpoints belong to (:mod:`.job`), decided by the coordinator from
    the root's job file and the save numbers the chain's tiers hold (one broadcast)."""
    node_dir = None if config.local_dir is None else local_root(config.local_dir, 0)
    return decide_on_coordinator(
        group,
        lambda: survey_job(root, node_dir, lambda u: open_store(u, {})),
        f"reading the job identity of {root.uri}",
    )
