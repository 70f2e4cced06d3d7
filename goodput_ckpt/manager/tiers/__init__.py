"""Two-tier checkpoints: node-local saves, replicas on other nodes, persistent saves less often.

``CheckpointManager(root, local_dir=..., replicas=1, persist_every=4)`` writes every save into
the node-local tier (:mod:`.local_tier`), keeps each rank's files on ``replicas`` other nodes
too, persists every ``persist_every``-th save to ``root`` from the local copy in the background
(:mod:`.persist`), and restores the newest step every rank can rebuild, each file from its
nearest intact copy (:mod:`.restore`). Nodes and replica partners: :mod:`.nodes`; moving a file
between tiers with every chunk checked: :mod:`.file_moves`. :class:`Tiers` is what the manager
holds. Details and the failure policy: ``docs/manager.md`` (Two tiers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...errors import CheckpointError
from ...state import Topology
from ...storage import open_store
from ...storage.base import Store
from ..disk_full import make_room
from ..job import JobState
from ..restoring import Restored, RestoreTarget
from ..retention import scan_steps
from ..save_job import SaveJob
from ..step_layout import child_uri, step_dir_name
from ..timeline import TimelineSink
from .local_tier import LocalTier
from .mend import LOCAL, PERSISTENT, REPLICA
from .nodes import NodeLayout
from .persist import Persister
from .restore import restore_tiers

__all__ = ["LOCAL", "PERSISTENT", "REPLICA", "Tiers"]


class Tiers:
    """The chain ``[local, replicas, persistent]`` of one two-tier manager, on one rank
    (``..chain.Chain``)."""

    names = (LOCAL, REPLICA, PERSISTENT)

    def __init__(self, local: LocalTier, persister: Persister, keep_last: int | None, config: Any) -> None:
        self.local = local
        self.persister = persister
        self.keep_last = keep_last
        self.config = config

    @classmethod
    def open(
        cls,
        config: Any,
        *,
        root_uri: str,
        storage_options: dict[str, Any],
        pg: dist.ProcessGroup | None,
        topology: Topology,
        local_world_size: int | None,
        timeline: TimelineSink,
        on_failure: Callable[[int, CheckpointError], None],
        job: JobState,
    ) -> Tiers:
        """Set up the tiers (collective when ``pg`` is given: a gloo group for the persist thread).

        Raises:
            ValueError: a bad layout (``LOCAL_WORLD_SIZE``, ``replicas``) or ``local_dir``.
        """
        layout = NodeLayout.of(
            topology.rank, topology.world_size, local_world_size=local_world_size, replicas=config.replicas
        )
        if pg is not None and dist.get_world_size(pg) != dist.get_world_size():
            raise ValueError(
                "two tiers (local_dir) need a process group over the whole job: the persist thread's "
                "own group is created over all ranks"
            )
        # The persist thread's collectives must never interleave with the save thread's.
        persist_pg = dist.new_group(backend="gloo") if pg is not None else None
        keep_local = config.local_keep_last if config.local_keep_last is not None else config.keep_last
        local = LocalTier(
            template=config.local_dir,
            layout=layout,
            pg=pg,
            persister=None,
            persist_every=config.persist_every,
            keep_last=keep_local,
            overwrite=config.overwrite,
            job=job,
        )
        persister = Persister(
            root_uri=root_uri,
            storage_options=storage_options,
            local=local.store,
            rank=topology.rank,
            world_size=topology.world_size,
            pg=persist_pg,
            keep_last=config.keep_last,
            overwrite=config.overwrite,
            timeline=timeline,
            on_failure=on_failure,
            job=job,
        )
        local.persister = persister
        return cls(local, persister, keep_local, config)

    def save_target(self, step: int) -> tuple[str, dict[str, Any]]:
        """Every save of ``step`` is written into this node's local directory first."""
        return self.local.step_uri(step), {}

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Step -> the tiers that hold a committed copy of it, seen from this rank: ``"local"``
        (this node's directory; it may hold only this node's files and replicas) and
        ``"persistent"``."""
        out: dict[int, list[str]] = {}
        for s in scan_steps(self.local.store).complete:
            out.setdefault(s, []).append(LOCAL)
        for s in scan_steps(self.persister.root).complete:
            out.setdefault(s, []).append(PERSISTENT)
        return {s: tuple(t) for s, t in sorted(out.items())}

    def manifest_store(self, step: int) -> Store:
        """This node's copy when it holds ``step`` committed, else the persistent tier's."""
        if LOCAL in self.step_tiers().get(step, ()):
            return self.local.step_store(step)
        return open_store(child_uri(self.persister.root.uri, step_dir_name(step)), self.persister.storage_options)

    def lists_steps(self) -> bool:
        """The coordinator (the persistent tier) and each node's first rank (its node's)."""
        layout = self.local.layout
        return layout.rank == 0 or layout.rank == layout.ranks_of(layout.node)[0]

    def after_write(self, job: SaveJob, err: CheckpointError | None) -> CheckpointError | None:
        """Spread the local save (manifest to every node, replicas, persist hand-off, local
        retention: ``.local_tier``). Never raises."""
        err, replicate_s = self.local.after_save(job.step, err)
        job.record.tier, job.record.replicate_s = LOCAL, replicate_s
        return err

    def apply_retention(self, committed: int) -> None:
        """Nothing here: each tier applies its own (``after_write``, the persist thread)."""

    def before_save(self, step: int) -> None:
        """Nothing to wait for: no tier retains beside the save thread."""

    def make_room(self, job: SaveJob) -> bool:
        """Room on the local disks, each node's by its first rank, sparing a persist's step."""
        local = self.local
        persisting = local.persister.in_flight_step if local.persister is not None else None
        return make_room(
            local.group,
            local.store,
            step=job.step,
            needed=job.record.bytes,
            owner_of={r: local.layout.ranks_of(local.layout.node_of(r))[0] for r in range(local.layout.world_size)},
            protect={persisting} - {None},
        )

    def wait(self, timeout_s: float | None) -> None:
        """Wait for the persist in flight."""
        self.persister.wait(timeout_s)

    def close(self) -> None:
        """Stop the persist thread (after the persist in flight) and release its group."""
        self.persister.shutdown()
        if self.persister.pg is not None and dist.is_initialized():
            dist.destroy_process_group(self.persister.pg)

    def restore(self, step: int | None, target: RestoreTarget) -> Restored | None:
        """:func:`.restore.restore_tiers` over these tiers, after the persist in flight."""
        self.wait(self.config.timeout_s)
        return restore_tiers(
            self.local,
            self.persister.root,
            step=step,
            keep_last=self.keep_last,
            verify=self.config.verify,
            target=target,
            persistent_options=self.persister.storage_options,
        )
